"""mkdocs hook: lay the kvforge package out as installed (build/docs-src) so mkdocstrings finds `kvforge.runtime`.

pyproject's package-dir maps top-level folders (runtime/, server/, tools/, builder/, plugins/) to kvforge.runtime
etc.; griffe reads sources from a directory tree, so it needs a tree where those folders sit under kvforge/.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the docs extra brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "docs-src"


def package_tree(root: Path, tree: Path) -> None:
    """Symlink each package's folder (pyproject package-dir) at its dotted place under `tree`."""
    mapping: dict[str, str] = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"]["package-dir"]
    shutil.rmtree(tree, ignore_errors=True)
    # Parents before children, so `kvforge/runtime` is linked inside the real `kvforge` directory we make.
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        target = tree.joinpath(*package.split("."))
        if target.exists():  # already reachable through its parent's link (runtime/context_cache under runtime/)
            continue
        if "." not in package:  # the top package: a real directory of links, so sub-packages can be added to it
            target.mkdir(parents=True)
            for child in (root / folder).iterdir():
                (target / child.name).symlink_to(child)
        else:
            target.symlink_to(root / folder, target_is_directory=True)


def on_startup(**_: Any) -> None:
    # on_startup, not on_config: mkdocstrings resolves its `paths` in its own on_config, which may run first.
    package_tree(ROOT, TREE)
