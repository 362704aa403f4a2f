"""mkdocs hook: adds the reference pages generated from the code (fleet.cli.reference).

The pages exist only in the built site, so they cannot disagree with the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# The checkout this mkdocs.yml sits in is the code the pages describe, even
# where another checkout of tidegate is installed in the environment.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.cli import reference


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path, text in reference.pages().items():
        files.append(File.generated(config, path, content=text))
    return files
