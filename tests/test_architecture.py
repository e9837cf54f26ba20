"""The package's layers point one way and no module imports itself: the import-linter contracts in
pyproject.toml hold, and a module-level graph has no cycle.

A wrong arrow (say, ``parallel`` importing ``train``) fails here with import-linter's report, which
names the contract, the importing and imported modules and the line. docs/architecture.md draws the
layers and says where each kind of change belongs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), "import-linter is missing: pip install -e '.[test]'"
    # The checked package is this checkout's, whatever copy the environment has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([str(lint_imports), "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or "0 broken" not in out.stdout:
        pytest.fail(f"import contracts broken (pyproject.toml [tool.importlinter]):\n{out.stdout}{out.stderr}",
                    pytrace=False)


def test_no_module_imports_itself_through_others():
    """No cycle of imports between the package's modules (every import, in a function or not). The
    ``no-cycles`` contract checks siblings at each depth but lets one package pair import each other
    (models.ops and models.qwen3, see pyproject.toml); this holds for every module, through that pair too."""
    import grimp

    graph = grimp.build_graph("qwen3_pretrain", cache_dir=None)
    cycles = [(module, *chain) for module in sorted(graph.modules)
              for imported in sorted(graph.find_modules_directly_imported_by(module))
              if (chain := graph.find_shortest_chain(importer=imported, imported=module))]
    assert not cycles, "import cycle(s):\n" + "\n".join(" -> ".join(c) for c in cycles)
