"""write_text_atomic never writes through a link planted at its temporary file's name."""

from __future__ import annotations

import os

from lightning_memopt.utilities.files import write_text_atomic


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("precious\n")
    folder = tmp_path / "oom"
    folder.mkdir()
    path = folder / "oom_report_rank0.json"
    (folder / f".{path.name}.{os.getpid()}.tmp").symlink_to(victim)  # the name is predictable: pid and file name
    write_text_atomic(path, '{"format": "report"}\n')
    assert victim.read_text() == "precious\n"
    assert path.read_text() == '{"format": "report"}\n' and not path.is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == [path.name]  # the link is gone, nothing else left
