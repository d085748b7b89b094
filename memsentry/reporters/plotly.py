"""Where the HTML report's charting library comes from: plotly.js, from the ``plotly`` package
(``pip install 'memsentry[html]'``), embedded whole in each page so the page opens offline."""

from __future__ import annotations

import importlib.resources
import importlib.util
from functools import lru_cache

from memsentry.errors import MemsentryError

INSTALL_HINT = "pip install 'memsentry[html]'"


class ChartsUnavailable(MemsentryError):
    """The HTML report's charts need plotly.js, which the ``plotly`` package carries."""


def have_plotly() -> bool:
    """Whether the ``plotly`` package (and so plotly.js) can be loaded."""
    return importlib.util.find_spec("plotly") is not None


@lru_cache(maxsize=1)
def plotly_js() -> str:
    """The minified plotly.js bundle (about 5 MB) that the ``plotly`` package ships."""
    if not have_plotly():
        raise ChartsUnavailable(
            f"the HTML report draws its charts with plotly.js, from the plotly package, which is "
            f"not installed: {INSTALL_HINT}"
        )
    try:
        bundle = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
        return bundle.read_text(encoding="utf-8")
    except (OSError, ModuleNotFoundError) as error:  # a damaged or stripped install
        raise ChartsUnavailable(
            f"the plotly package has no readable plotly.min.js ({error}); reinstall it: "
            f"{INSTALL_HINT}"
        ) from None


__all__ = ["INSTALL_HINT", "ChartsUnavailable", "have_plotly", "plotly_js"]
