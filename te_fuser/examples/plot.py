"""The end-of-run picture: loss and memory over the steps."""

from pathlib import Path


def plot_history(history, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [h["loss"] for h in history])
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    for key in ("current", "peak"):
        ax_mem.plot(steps, [h[key] / 2**20 for h in history], label=key)
    ax_mem.set(xlabel="step", ylabel="MiB allocated by torch", title="memory per step")
    ax_mem.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
