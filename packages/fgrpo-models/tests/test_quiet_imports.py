"""Quiet runs: the import-time message transformers prints on every sd3 run (torchvision missing,
falling back to the PIL image processors, which our backbones never use) is filtered where
fgrpo-models imports diffusers, and only that message."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("diffusers")


def test_torchvision_fallback_message_is_filtered_at_the_source():
    code = textwrap.dedent(
        """
        import logging
        import fgrpo.models._diffusers
        (quiet,) = logging.getLogger("transformers.utils.import_utils").filters
        dropped, keep = [], quiet.filter
        quiet.filter = lambda record: keep(record) or dropped.append(record.getMessage())
        from diffusers import StableDiffusion3Pipeline
        print(len(dropped))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if result.stdout.strip() == "0":
        pytest.skip("this transformers/torchvision combination prints no fallback message")
    assert "requires torchvision" not in result.stderr  # transformers said it; nobody saw it


def test_the_filter_drops_nothing_else():
    import fgrpo.models._diffusers  # noqa: F401  (installs the filter)

    logger = logging.getLogger("transformers.utils.import_utils")
    keep = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "something else is wrong", None, None)
    drop = logging.LogRecord(
        logger.name,
        logging.WARNING,
        __file__,
        1,
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`",
        None,
        None,
    )
    assert logger.filter(keep) and not logger.filter(drop)
    assert logging.getLogger("transformers").filters == []  # nothing global
