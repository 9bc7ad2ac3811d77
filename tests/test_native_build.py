"""The native kernels' cache key covers every file the compiler reads, so an edited header builds afresh."""
from __future__ import annotations

import re
import shutil

from mesh.core.model.native import HEADERS, SOURCES, library_name


def test_every_included_header_is_part_of_the_key():
    included = {m for src in SOURCES for m in re.findall(r'#include "([^"]+)"', src.read_text())}
    assert included and included <= {h.name for h in HEADERS}


def test_an_edited_header_names_another_library(tmp_path):
    for p in SOURCES + HEADERS:
        shutil.copy(p, tmp_path / p.name)
    files = tuple(tmp_path / p.name for p in SOURCES + HEADERS)
    before = library_name(files)
    header = tmp_path / HEADERS[0].name
    text = header.read_text()
    header.write_text(text + "\n/* edited */\n")
    assert library_name(files) != before
    header.write_text(text)
    assert library_name(files) == before  # the bytes alone name it: the edit undone, the same library
