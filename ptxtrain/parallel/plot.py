"""Draw a recorded pipeline timeline like DeepSeek-V3's DualPipe figure (report §3.2.1, Fig. 5).

``ptxtrain plot timeline RUN_DIR [--out PNG] [--step K]`` calls :func:`plot_timeline`: ranks as
rows (rank 0 on top), one rectangle per compute cell coloured by kind (F, B = input grads, W =
deferred weight grads, B+W = a full backward), the micro-batch id written in it, cells of
direction 1 (DualPipe's second direction, DualPipeV's up leg) in a darker shade; communication as
a thin strip under each row (receive = waiting for a peer, send = posting). Bubbles are the gaps.
Time runs from the earliest step start over all ranks. Matplotlib's Agg backend, no display.
"""

from __future__ import annotations

from pathlib import Path

from ptxtrain.parallel.timeline import BubbleStats, bubble_stats, read_timelines

# kind -> (direction 0 colour, direction 1 colour)
_COLOURS = {
    "F": ("#f6b26b", "#c9792a"),
    "B": ("#93c47d", "#4f8f3a"),
    "W": ("#6fa8dc", "#2f6aa3"),
    "BW": ("#c27ba0", "#8e3f6c"),
}
_LABELS = {"F": "F (forward)", "B": "B (input grad)", "W": "W (weight grad)", "BW": "B+W (full)"}
_COMM_COLOURS = {"recv": "#cc0000", "send": "#999999"}


def select_step(timelines: dict[int, list[dict]], step: int = -1) -> list[dict]:
    """One step record per rank: ``step`` indexes each rank's list (negative from the end).

    Raises:
        ValueError: ``step`` out of range for some rank (the message gives the ranges).
    """
    out = []
    for rank in sorted(timelines):
        steps = timelines[rank]
        if not -len(steps) <= step < len(steps):
            raise ValueError(f"step {step} out of range: rank {rank} recorded {len(steps)} step(s)")
        out.append(steps[step])
    return out


def format_bubble(stats: BubbleStats) -> str:
    """Human-readable summary: mean cell times and measured vs predicted bubble fraction."""
    ms = 1e-6
    return (
        f"{stats.schedule}: {stats.world} rank(s), {stats.num_chunks} micro-batches, "
        f"step {stats.window_ns * ms:.3f} ms\n"
        f"mean F {stats.f_ns * ms:.3f} ms, B (full) {stats.b_ns * ms:.3f} ms, "
        f"W {stats.w_ns * ms:.3f} ms, F&B {stats.fb_ns * ms:.3f} ms\n"
        f"bubble fraction: measured {stats.measured:.3f}, "
        f"formula {stats.formula} = {stats.predicted_ns * ms + 0.0:.3f} ms -> {stats.predicted:.3f}"
    )


def plot_timeline(
    run_dir: str | Path, out: str | Path | None = None, step: int = -1
) -> tuple[Path, BubbleStats]:
    """Draw ``run_dir``'s timelines (step ``step`` of each rank) to a PNG.

    Args:
        run_dir: folder with ``timeline_rank{r}.jsonl`` files (``Timeline.write``).
        out: PNG path (default ``run_dir/timeline.png``); parent folders are created.
        step: which recorded step (index into each rank's steps; -1 = the last).

    Returns:
        ``(png_path, stats)`` with ``stats`` from :func:`~ptxtrain.parallel.timeline.bubble_stats`.

    Raises:
        FileNotFoundError: no timeline in ``run_dir``.
        ValueError: unreadable timeline, ``step`` out of range, ranks of different runs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    run_dir = Path(run_dir)
    steps = select_step(read_timelines(run_dir), step)
    stats = bubble_stats(steps)
    out = Path(out) if out is not None else run_dir / "timeline.png"
    out.parent.mkdir(parents=True, exist_ok=True)

    t0 = min(s["start_ns"] for s in steps)
    span_ms = max(stats.window_ns, 1) * 1e-6
    world = stats.world
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * world), dpi=120)
    for s in steps:
        y = world - 1 - s["rank"]
        for c in s["cells"]:
            x0, width = (c["start_ns"] - t0) * 1e-6, (c["end_ns"] - c["start_ns"]) * 1e-6
            if c["kind"] in _COLOURS:
                colour = _COLOURS[c["kind"]][1 if c["dir"] else 0]
                ax.add_patch(
                    plt.Rectangle(
                        (x0, y + 0.2), width, 0.7, facecolor=colour, edgecolor="black", lw=0.3
                    )
                )
                if width > span_ms / 400:  # label cells wide enough to hold a digit or two
                    ax.text(
                        x0 + width / 2,
                        y + 0.55,
                        str(c["chunk"]),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if c["dir"] else "black",
                        clip_on=True,
                    )
            else:
                ax.add_patch(
                    plt.Rectangle(
                        (x0, y + 0.04), width, 0.12, facecolor=_COMM_COLOURS[c["kind"]], lw=0
                    )
                )
    ax.set_xlim(0, span_ms)
    ax.set_ylim(0, world)
    ax.set_yticks([world - 1 - r + 0.5 for r in range(world)])
    ax.set_yticklabels([f"rank {r}" for r in range(world)])
    ax.set_xlabel("time (ms)")
    ax.set_title(
        f"{stats.schedule}, {world} rank(s), {stats.num_chunks} micro-batches: bubble "
        f"measured {stats.measured:.1%}, formula {stats.formula} -> {stats.predicted:.1%}",
        fontsize=9,
    )
    handles = [Patch(facecolor=_COLOURS[k][0], label=_LABELS[k]) for k in _COLOURS]
    handles += [Patch(facecolor=_COLOURS["F"][1], label="darker: direction 1")]
    handles += [Patch(facecolor=v, label=f"{k} (strip)") for k, v in _COMM_COLOURS.items()]
    ax.legend(
        handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=7, frameon=False
    )
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out, stats


__all__ = ["format_bubble", "plot_timeline", "select_step"]
