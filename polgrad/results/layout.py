"""Layout of the report's figures: room for what is written around the panels, measured on the drawn
figure (a fixed margin either squeezed panels to slivers or let titles overprint)."""

from __future__ import annotations


def clear_top(fig, above, gap_px: float = 6.0) -> None:
    """Lower the panels until nothing of theirs (titles, tick labels) reaches into the artists `above`
    them (the suptitle, a legend): a tall figure's fixed top margin let the two overprint."""
    above = [a for a in above if a is not None]
    for _ in range(3):  # the panels' titles move with their tops; a second pass settles any rounding
        fig.draw_without_rendering()  # the layout of a draw (ticks, texts) without rasterising it
        r = fig.canvas.get_renderer()
        floor = min((a.get_window_extent(r).y0 for a in above), default=fig.bbox.height)
        top = max((ax.get_tightbbox(r).y1 for ax in fig.axes if ax.get_visible()), default=0.0)
        if top <= floor - gap_px:
            return
        fig.subplots_adjust(top=fig.subplotpars.top - (top - floor + gap_px) / fig.bbox.height)


PANEL_IN = 3.4  # a forest panel's own width, whatever the labels beside it take


def widen_for_labels(fig, twins, left) -> None:
    """Make the figure as wide as its labels need: the configurations' names on the left and each
    panel's Δ and p text on its right, measured, plus `PANEL_IN` per panel; a fixed width let long
    names (overoptimization's four bindings) squeeze the panels to slivers with overprinted ticks."""
    fig.draw_without_rendering()
    r = fig.canvas.get_renderer()

    def widest(labels) -> float:
        return max((t.get_window_extent(r).width for t in labels if t.get_text()), default=0.0) / fig.dpi

    right = max((widest(tw.get_yticklabels()) for tw in twins), default=0.0)
    need = widest(left.get_yticklabels()) + len(twins) * (PANEL_IN + right + 0.35) + 0.6
    w, h = fig.get_size_inches()
    if need > w:
        fig.set_size_inches(need, h)
