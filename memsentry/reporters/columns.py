"""The layer table's columns, defined once for every reporter: the heading, what the column
says (the HTML page's tooltip, the docs), the :class:`~memsentry.model.LayerStats` field it
shows, whether the page draws it with a bar and whether the totals row sums it."""

from __future__ import annotations

from dataclasses import dataclass

from memsentry.model import Breakdown, LayerStats
from memsentry.reporters.breakdown import layer_share
from memsentry.units import format_bytes


@dataclass(frozen=True)
class LayerColumn:
    heading: str
    about: str
    attr: str | None = None  # None: the name, the type, or the share of the peak
    bar: bool = False
    summed: bool = False

    @property
    def lines(self) -> tuple[str, str]:
        """The heading on two lines, as the text table prints it: ``("fwd", "peak")``."""
        first, _, last = self.heading.rpartition(" ")
        return first, last

    def cell(self, layer: LayerStats, peak: Breakdown | None) -> str:
        """The column's text for ``layer`` (sizes compact: ``128KiB``)."""
        if self.heading == "layer":
            return layer.name
        if self.heading == "type":
            return layer.type
        if self.attr is None:
            return layer_share(layer, peak)
        value = getattr(layer, self.attr)
        if self.attr == "calls":
            return calls_cell(layer)
        return format_bytes(value, compact=True)


def calls_cell(layer: LayerStats) -> str:
    """The forward calls of ``layer``, marked ``>=`` when some ran without a hook of
    memsentry's on it (they went uncounted)."""
    return str(layer.calls) if layer.calls_complete else f">={layer.calls}"


LAYER_COLUMNS: tuple[LayerColumn, ...] = (
    LayerColumn("layer", "module path (indented by depth)"),
    LayerColumn("type", "module class"),
    LayerColumn("calls", "forward calls (>=: some ran with no hook on the module, in light "
                "iterations or outside the window of layers measured, and went uncounted)",
                "calls"),
    LayerColumn("params", "parameters of the module and its children", "param_bytes",
                summed=True),
    LayerColumn("output", "storage of the tensors the forward returned", "output_bytes",
                summed=True),
    LayerColumn("saved", "activations saved for backward (largest call)", "saved_bytes",
                bar=True, summed=True),
    LayerColumn("of peak", "saved bytes over the highest iteration peak"),
    LayerColumn("fwd Δ", "allocated after the forward minus before", "forward_delta"),
    LayerColumn("fwd peak", "highest allocated during the forward minus before",
                "forward_peak", bar=True),
    LayerColumn("bwd Δ", "allocated after the backward minus before", "backward_delta"),
    LayerColumn("bwd peak", "highest allocated during the backward minus before",
                "backward_peak", bar=True),
)


__all__ = ["LAYER_COLUMNS", "LayerColumn"]
