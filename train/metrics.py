"""Per-step metrics: JSONL (OUT/metrics.jsonl), TensorBoard (OUT/tensorboard/), loss-curve PNG."""
import json
import os

from kdcache.common.atomic import atomic_write_bytes

METRICS = "metrics.jsonl"


class Metrics:
    def __init__(self, out, enabled, resume_step=0):
        self.enabled = enabled
        self.path = os.path.join(out, METRICS)
        self.tb = None
        if not enabled:
            return
        # Lines past the resumed checkpoint belong to steps that will be redone: drop them.
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self._f = open(self.path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=resume_step + 1)
        except ImportError:
            self.tb = None

    def log(self, row):
        if not self.enabled:
            return
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self.tb:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def close(self):
        if self.enabled:
            self._f.close()
            if self.tb:
                self.tb.close()


def read_metrics(path):
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break          # a line cut by a crash: everything before it is good
    return rows


def plot_loss_curve(out, title="distillation loss"):
    """Write OUT/loss_curve.png from metrics.jsonl; returns its path (None if no rows)."""
    rows = read_metrics(os.path.join(out, METRICS))
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], label="loss")
    if any(r.get("sft") for r in rows):
        ax.plot(steps, [r["kd"] for r in rows], label="kd", alpha=0.7)
        ax.plot(steps, [r["sft"] for r in rows], label="sft", alpha=0.7)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss per trained position")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out, "loss_curve.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
