"""Open each built API page in headless Chromium at a 1280-pixel-wide window; fail if a signature is wider than its
box or anything sticks out of the content column, and save a screenshot of each page.

    python scripts/check_api_pages.py SITE_DIR [--screenshots DIR]

SITE_DIR is the output of ``mkdocs build``. Exit status: 0 when nothing overflows, 1 when something does, 2 when no
Chromium is installed (``chromium``, ``chromium-browser`` or ``google-chrome`` on PATH, or ``$CHROMIUM``).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH = 1280
#: Chromium draws no taller window than this; a longer page is cut there.
MAX_HEIGHT = 16384
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
#: Runs at the page's load and writes to an attribute of <body>, which --dump-dom carries out: the page's height and,
#: in the main content, each element that is wider than its box in a signature (a signature must fit), each other
#: element that sticks out of the content column (unless a scrolling box holds it), and each box that scrolls
#: sideways (a long example line: a note, not a failure).
MEASURE = """<script>
window.addEventListener("load", () => {
  const content = document.querySelector(".md-content");
  const edge = content.getBoundingClientRect().right;
  const scrolls = (element) => ["auto", "scroll", "hidden"].includes(getComputedStyle(element).overflowX);
  const held = (element) => {
    for (let up = element.parentElement; up && up !== content; up = up.parentElement) if (scrolls(up)) return true;
    return false;
  };
  const found = [];
  let place = "";
  for (const element of content.querySelectorAll("*")) {
    if (/^H[1-6]$/.test(element.tagName) && element.id) place = element.id;
    const wide = element.clientWidth > 0 && element.scrollWidth > element.clientWidth + 1;
    let kind = null;
    if (wide && element.closest(".doc-signature")) kind = "signature";
    else if (wide && scrolls(element)) kind = "scrolls";
    else if (element.getBoundingClientRect().right > edge + 1 && !held(element)) kind = "sticks-out";
    if (kind) found.push({kind: kind, place: place, element: element.tagName.toLowerCase() + "." + element.className,
                          scroll: element.scrollWidth, client: element.clientWidth,
                          text: element.textContent.trim().slice(0, 100)});
  }
  const report = {height: document.documentElement.scrollHeight, overflowing: found};
  document.body.setAttribute("data-api-check", JSON.stringify(report));
});
</script>"""
#: Kinds of overflow that fail the check; "scrolls" (a code example with a scroll bar) is only listed.
FAILING = ("signature", "sticks-out")
_REPORT = re.compile(r'data-api-check="([^"]*)"')


def find_browser() -> str | None:
    """The Chromium to run: ``$CHROMIUM``, else the first of :data:`BROWSERS` on PATH; None when there is none."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next(filter(None, map(shutil.which, BROWSERS)), None)


def api_pages(site: Path) -> list[Path]:
    return sorted((site / "api").glob("*/index.html")) or sorted((site / "api").glob("*.html"))


def run_browser(browser: str, url: str, *options: str) -> str:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *options, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    return done.stdout


def measure(browser: str, page: Path) -> dict:
    """The page's height and overflowing elements, from a copy of it with :data:`MEASURE` added."""
    probe = page.with_name(f".check-{page.name}")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", f"{MEASURE}</body>"), encoding="utf-8")
    try:
        dom = run_browser(browser, probe.as_uri(), f"--window-size={WIDTH},1000", "--dump-dom")
    finally:
        probe.unlink()
    found = _REPORT.search(dom)
    if found is None:
        raise RuntimeError(f"{browser} gave no measurement for {page}")
    return json.loads(html.unescape(found.group(1)))


def screenshot(browser: str, page: Path, height: int, path: Path) -> None:
    size = f"--window-size={WIDTH},{min(max(height, 600), MAX_HEIGHT)}"
    run_browser(browser, page.as_uri(), size, f"--screenshot={path}")


def describe(name: str, item: dict) -> str:
    where = f"api/{name} #{item['place']}: <{item['element']}>"
    return f"{item['kind']}: {where} is {item['scroll']}px wide in {item['client']}px: {item['text']!r}"


def check(site: Path, browser: str, screenshots: Path | None) -> tuple[list[str], list[str]]:
    """The overflowing elements of each API page of ``site``: those that fail the check, and the notes."""
    problems, notes = [], []
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "site"  # the probes are written beside the pages: into a copy, not the build
        shutil.copytree(site, copy)
        for page in api_pages(copy):
            name = page.parent.name if page.name == "index.html" else page.stem
            report = measure(browser, page)
            for item in report["overflowing"]:
                (problems if item["kind"] in FAILING else notes).append(describe(name, item))
            if screenshots is not None:
                screenshots.mkdir(parents=True, exist_ok=True)
                screenshot(browser, page, report["height"], screenshots / f"{name}.png")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the folder mkdocs built")
    parser.add_argument("--screenshots", type=Path, help="save a PNG of each API page here")
    args = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print("check_api_pages: no Chromium found (install the Debian package chromium)", file=sys.stderr)
        return 2
    if not api_pages(args.site):
        print(f"check_api_pages: no API pages under {args.site}/api", file=sys.stderr)
        return 1
    problems, notes = check(args.site, browser, args.screenshots)
    print(*notes, *problems, sep="\n")
    pages = len(api_pages(args.site))
    print(f"check_api_pages: {pages} API pages; {len(problems)} overflowing, {len(notes)} scrolling boxes (notes)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
