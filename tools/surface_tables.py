"""Write the published surface tables (docs/surface/<framework>.md) from the adapters' declared
surfaces: ``python tools/surface_tables.py`` (from the repository root, with the frameworks
installed). The tests fail when a committed table differs from the generated one.

Each adapter declares its surface as a ``SURFACE`` (:class:`polyparallel.testing.surface.Surface`)
in ``plugins/polyparallel_<x>/surface.py``; add a line to ``SURFACES`` for a new one."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SURFACES = {"fastai": "polyparallel_fastai.surface", "ignite": "polyparallel_ignite.surface",
            "lightning": "polyparallel_lightning.surface"}


def main() -> int:
    for path in (ROOT, ROOT / "plugins"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    for name, module in SURFACES.items():
        surface = importlib.import_module(module).SURFACE
        out = ROOT / "docs" / "surface" / f"{name}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(surface.markdown(), encoding="utf-8")
        works, refused, total = surface.counts()
        print(f"{out.relative_to(ROOT)}: {works} work, {refused} refused, {total} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
