#!/usr/bin/env bash
# The documentation site (MkDocs + Material + mkdocstrings), from a fresh clone:
#   bash tools/docs.sh            # mkdocs build --strict into site/: a broken link or anchor, a missing
#                                 # page, snippet or API reference fails the build
#   bash tools/docs.sh --serve    # serve it on http://127.0.0.1:8000, rebuilt on every edit
# Extra arguments go to mkdocs. MKDOCS=path/to/mkdocs uses that mkdocs instead of .venv's (tools/env.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${MKDOCS:-}" ]; then
    source "$ROOT/tools/env.sh"
    MKDOCS=mkdocs
fi
cd "$ROOT"
export NO_MKDOCS_2_WARNING=1   # MkDocs 1.6 prints a banner about its successor otherwise
if [ "${1:-}" = "--serve" ]; then
    shift
    exec "$MKDOCS" serve --strict "$@"
fi
exec "$MKDOCS" build --strict "$@"
