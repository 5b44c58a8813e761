"""Out-of-memory reports: from the facts at a failure to a report dict, and from the dict to Markdown.

Nothing here needs a Trainer. :class:`~lightning_memopt.callbacks.OOMReporter` reads what only it can reach at
the moment of failure and hands it to these functions:

* :mod:`.schema`: :class:`OOMReport`, every key of the JSON report (``docs/oom-report.md`` describes them);
* :mod:`.report`: :func:`build_oom_report` assembles a report from values and readers;
* :mod:`.batch`: :func:`describe_batch`, shapes, dtypes and devices of the tensors in a batch (any nesting);
* :mod:`.message`: :func:`parse_oom_message`, the numbers in an allocator's error message;
* :mod:`.environment`: :func:`collect_environment` (allow-listed, secrets redacted), :func:`allocator_settings`,
  :func:`collect_versions`;
* :mod:`.suggestions`: :func:`suggest_fixes`, ranked, concrete suggestions derived from the numbers;
* :mod:`.sections`: the other parts (error, failing batch, who holds memory, checkpointing, hparams, snapshot);
* :mod:`.markdown`: :func:`render_markdown`, the readable report;
* :mod:`.files`: the report's file names, its JSON text, :func:`load_report`;
* :mod:`.store`: every report kept under a name of its own, the documented names on the newest (:func:`save_report`).
"""

from lightning_memopt.functional.oom.batch import batch_padding, describe_batch, mask_lengths
from lightning_memopt.functional.oom.environment import (
    ALLOCATOR_ENV_VARS,
    ENV_PREFIXES,
    allocator_settings,
    collect_environment,
    collect_versions,
)
from lightning_memopt.functional.oom.files import load_report, report_json, report_paths
from lightning_memopt.functional.oom.markdown import render_markdown
from lightning_memopt.functional.oom.message import parse_oom_message
from lightning_memopt.functional.oom.report import (
    ReportSources,
    SectionGuard,
    TrainerPosition,
    TrainerSettings,
    build_oom_report,
    failure_memory,
    failure_position,
)
from lightning_memopt.functional.oom.schema import (
    REPORT_FORMAT,
    CheckpointingState,
    DataLengths,
    MemorySection,
    OOMReport,
)
from lightning_memopt.functional.oom.sections import checkpointing_state, memory_section, take_snapshot
from lightning_memopt.functional.oom.store import (
    ReportSlot,
    kept_reports,
    newest_reports,
    publish_newest,
    reserve_report,
    save_report,
)
from lightning_memopt.functional.oom.suggestions import suggest_fixes
from lightning_memopt.utilities.redaction import REDACTED, is_secret_name  # kept importable here

__all__ = [
    "DataLengths",
    "ALLOCATOR_ENV_VARS",
    "ENV_PREFIXES",
    "REDACTED",
    "REPORT_FORMAT",
    "CheckpointingState",
    "MemorySection",
    "OOMReport",
    "ReportSlot",
    "ReportSources",
    "SectionGuard",
    "TrainerPosition",
    "TrainerSettings",
    "allocator_settings",
    "build_oom_report",
    "checkpointing_state",
    "collect_environment",
    "collect_versions",
    "batch_padding",
    "describe_batch",
    "mask_lengths",
    "failure_memory",
    "failure_position",
    "is_secret_name",
    "kept_reports",
    "load_report",
    "memory_section",
    "newest_reports",
    "parse_oom_message",
    "publish_newest",
    "render_markdown",
    "report_json",
    "report_paths",
    "reserve_report",
    "save_report",
    "suggest_fixes",
    "take_snapshot",
]
