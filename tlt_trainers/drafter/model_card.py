"""A README.md model card for a published drafter: what it is aligned to, how well, and how to load it."""

from __future__ import annotations

import os
from pathlib import Path

from .registry import kind_of

TAGS = ["speculative-decoding", "eagle", "draft-model", "tlt-trainers", "vllm", "sglang"]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _rows_table(first: str, rows: dict) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows.values() for k in row))
    lines = [f"| {first} | " + " | ".join(map(_cell, columns)) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {_cell(name)} | " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |"
              for name, row in rows.items()]
    return lines


def acceptance_table(acceptance) -> str:
    """Markdown tables of measured acceptance.

    ``{"acceptance_length": 1.9, "speedup": 1.16}`` gives a metric/value table; ``{"greedy, k=4": {"acceptance_length":
    1.9, ...}, "temperature 1": {...}}`` one row per setting and one column per metric. A ``GenerationStats`` (the
    ``.stats`` of ``SpeculativeGenerator.generate``) or its ``to_dict()`` gives its counters and a per-batch-size
    table (``buckets``).
    """
    if hasattr(acceptance, "to_dict"):
        acceptance = acceptance.to_dict()
    if not acceptance:
        return ("Not measured yet: pass `acceptance=` a dict of metrics or the `.stats` of "
                "`SpeculativeGenerator.generate(...)`.")
    if all(isinstance(v, dict) for v in acceptance.values()):
        return "\n".join(_rows_table("setting", acceptance))
    scalars = {}
    for key, value in acceptance.items():
        if isinstance(value, dict) and not all(isinstance(v, dict) for v in value.values()):
            scalars.update({f"{key}.{k}": v for k, v in value.items()})
        elif not isinstance(value, dict):
            scalars[key] = value
    lines = ["| metric | value |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in scalars.items()]
    for key, value in acceptance.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            lines += [""] + _rows_table(key, value)
    return "\n".join(lines)


def write_model_card(
    drafter,
    out_dir: str | os.PathLike,
    policy_name: str | None = None,
    acceptance=None,
    *,
    repo_id: str | None = None,
    num_speculative_tokens: int = 3,
    vllm_model: str | None = None,
    sglang_model: str | None = None,
    training: dict | None = None,
    license: str | None = None,
    acceptance_source: str | None = None,
    measurements: list[dict] | None = None,
) -> Path:
    """Write ``out_dir/README.md``: YAML front matter (``library_name``, ``tags``, ``base_model`` = the policy) and
    what the drafter is aligned to, its measured acceptance, and how to load it in tlt_trainers, vLLM and SGLang.

    ``policy_name``: the policy's Hub id (default: the ``target_name_or_path`` the drafter was made for).
    ``acceptance``: measured acceptance (a dict, or generation stats), rendered by :func:`acceptance_table`.
    ``repo_id``: where this folder is published (used in the load snippets). ``vllm_model``/``sglang_model``: where
    exports made with ``tlt_trainers.drafter.export`` are published; when None the snippets show the export step.
    ``training``: facts about training (steps, tokens, rollouts, ...), listed as given. ``acceptance_source``: where
    the acceptance figures come from (the command and result file that measured them). ``measurements``: the same
    drafter measured on several machines, each ``{"machine": ..., "source": ..., "acceptance": ..., "results": ...}``:
    one subsection per machine, headed by the machine and its results file, its source line (the command, the date)
    above its table;
    ``acceptance_source`` is then said once above them. Returns the README path.
    """
    from huggingface_hub import ModelCardData

    c = drafter.config
    policy = policy_name or c.target_name_or_path
    here = repo_id or "path/to/this/folder"
    k = int(num_speculative_tokens)
    tags = list(kind_of(drafter).model_card_tags or TAGS)  # where each kind is served (a block drafter: dflash)
    data = ModelCardData(library_name="tlt-trainers", tags=tags, base_model=policy or None, license=license)
    vocab = (f"{c.draft_vocab_size} of the policy's {c.vocab_size} tokens (draft vocabulary; verification "
             "stays over the full vocabulary)" if c.uses_draft_vocab else f"the policy's full {c.vocab_size} tokens")
    params = sum(p.numel() for p in drafter.parameters())
    policy_text = f"[`{policy}`](https://huggingface.co/{policy})" if policy else "its policy (name not recorded)"

    block = c.architecture == "BlockDrafter"
    eagle3 = c.architecture == "Eagle3Drafter"
    method, algorithm = ("eagle3", "EAGLE3") if eagle3 else ("eagle", "EAGLE")
    vllm_export, sglang_export = ("export_eagle3_vllm", "export_eagle3_sglang") if eagle3 else ("export_vllm",
                                                                                              "export_sglang")
    module = "tlt_trainers.drafter.export_eagle3" if eagle3 else "tlt_trainers.drafter.export"
    vllm_lines, sglang_lines = [], []
    export_shown = vllm_model is None  # the snippet exports the drafter first (nothing published yet)
    if vllm_model is None:
        vllm_model = "drafter-vllm"
        full = ", full_vocab_head=True" if c.uses_draft_vocab and not eagle3 else ""
        vllm_lines = [f"from {module} import {vllm_export}",
                      f'{vllm_export}(drafter, "{vllm_model}", "{policy or "POLICY"}"{full})']
    if sglang_model is None:
        sglang_model = "drafter-sglang"
        sglang_lines = [f"from {module} import {sglang_export}",
                        f'{sglang_export}(drafter, "{sglang_model}", "{policy or "POLICY"}")']
    vllm_lines += ["from vllm import LLM",
                   f'llm = LLM(model="{policy or "POLICY"}",',
                   f'          speculative_config={{"method": "{method}", "model": "{vllm_model}", '
                   f'"num_speculative_tokens": {k}}})']
    launch = [f"python -m sglang.launch_server --model-path {policy or 'POLICY'} \\",
              f"  --speculative-algorithm {algorithm} --speculative-draft-model-path {sglang_model} \\",
              f"  --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]
    if c.uses_draft_vocab and not eagle3:
        launch[-1] += " \\"
        launch.append(f"  --speculative-token-map {sglang_model}/hot_token_map.pt")

    if block:
        method, k = "dflash", min(k, c.block_size - 1)
        vllm_export, module = "export_block_vllm", "tlt_trainers.drafter.export_block"
        vllm_lines = [f'drafter.export("{vllm_model}", "vllm", "{policy or "POLICY"}")'] if export_shown else []
        vllm_lines += ["from vllm import LLM",
                       f'llm = LLM(model="{policy or "POLICY"}",',
                       f'          speculative_config={{"method": "dflash", "model": "{vllm_model}", '
                       f'"num_speculative_tokens": {k}}})']
        title, paper = "DFlash-style block", "https://github.com/z-lab/dflash"
        reads = (f"{policy_text}: the drafter reads a fusion of this policy's layers {list(c.aux_layer_ids)} as "
                 "context and takes its embedding (not stored here); it drafts a block of "
                 f"{c.block_size - 1} tokens in one pass with its own head.")
        layout = (f"DFlash (vLLM's `DFlashQwen3ForCausalLM`): `fc` and `hidden_norm` over the fused layers, "
                  f"{c.num_hidden_layers} Qwen3 decoder layer(s), a learnt mask embedding, its own norm and LM head")
    elif eagle3:
        title, paper = "EAGLE-3", "https://arxiv.org/abs/2503.01840"
        reads = (f"{policy_text}: the drafter reads a fusion of this policy's hidden states entering layers "
                 f"{list(c.aux_layer_ids)} and takes its embedding (not stored here); it scores tokens with its own "
                 "head.")
        later = (f", then {c.num_hidden_layers - 1} plain Llama decoder layer(s)" if c.num_hidden_layers > 1
                 else "")
        layout = ("EAGLE-3: `fc` fuses three policy layers, one Llama decoder layer over [embedding; feature]"
                  f"{later}, its own norm and LM head over the draft vocabulary")
    else:
        title, paper = "EAGLE", "https://arxiv.org/abs/2401.15077"
        reads = (f"{policy_text}: the drafter reads this policy's final hidden states and scores through its "
                 "embedding and LM head (neither is stored here).")
        layout = "EAGLE-1: `fc`(embedding, hidden state), one Llama decoder layer without its input norm"
    size = "one-layer" if c.num_hidden_layers == 1 else f"{c.num_hidden_layers}-layer"
    out = [
        f"# {title} drafter for {policy or 'its policy'}",
        "",
        f"A {size} [{title}]({paper}) drafter for lossless speculative decoding, trained with",
        "tlt-trainers on the policy's own hidden states. It proposes tokens; the policy",
        "verifies them, so what is generated is exactly what the policy alone would generate. A better drafter only",
        "makes it faster.",
        "",
        "## Aligned to",
        "",
        reads,
        "It was trained on the policy's own answers and tracks the checkpoint it was",
        "last trained on: use it with exactly that policy; with another checkpoint acceptance drops (outputs stay",
        "exact).",
        "",
        "| | |",
        "|---|---|",
        f"| layout | {layout} |",
        f"| hidden size / heads / KV heads / head dim | {c.hidden_size} / {c.num_attention_heads} / "
        f"{c.num_key_value_heads} / {c.head_dim} |",
        f"| MLP size | {c.intermediate_size} |",
        f"| drafts over | {vocab} |",
        f"| parameters (own) | {params:,} |",
        "",
    ]
    if training:
        out += ["Training:", ""] + [f"- {_cell(key)}: {_cell(value)}" for key, value in training.items()] + [""]
    out += [
        "## Measured acceptance",
        "",
        "Acceptance length: mean number of tokens produced per policy forward pass (1 means no gain).",
        "",
        *_measured(acceptance, acceptance_source, measurements),
        "## Use it",
        "",
        "tlt-trainers (the files in this folder):",
        "",
        "```python",
        "from tlt_trainers import Drafter, SpeculativeGenerator",
        f'drafter = Drafter.from_pretrained("{here}", target=model)  # model: the policy above',
        "gen = SpeculativeGenerator(model, drafter)",
        "```",
        "",
        f"vLLM (written by `{module}.{vllm_export}`):",
        "",
        "```python",
        *vllm_lines,
        "```",
        "",
    ]
    if c.uses_draft_vocab and not eagle3 and not block:
        out += ["vLLM's EAGLE-1 drafter has no draft vocabulary: its export drafts over the full vocabulary",
                "(`full_vocab_head=True`). Outputs are unchanged; drafting costs more than here.", ""]
    if block:  # vLLM only: SGLang's DFlash loader is not targeted
        return _save_card(data, out, out_dir)
    out += [f"SGLang (written by `{module}.{sglang_export}`):", ""]
    if sglang_lines:
        out += ["```python", *sglang_lines, "```", ""]
    out += ["```bash", *launch, "```", ""]
    if c.uses_draft_vocab and not eagle3:
        out += ["The token map keeps the draft vocabulary: without `--speculative-token-map` SGLang would draft over",
                "the full vocabulary.", ""]
    return _save_card(data, out, out_dir)


def _measured(acceptance, source: str | None, measurements: list[dict] | None) -> list[str]:
    """The lines of the measured-acceptance section: one table, or one subsection per machine."""
    if not measurements:
        return [acceptance_table(acceptance), "", *([source, ""] if source else [])]
    lines = [source, ""] if source else []
    for measurement in measurements:
        heading = measurement["machine"] + (f" (`{measurement['results']}`)" if measurement.get("results") else "")
        lines += [f"### {heading}", "", measurement["source"], "",
                  acceptance_table(measurement["acceptance"]), ""]
    return lines


def _save_card(data, lines: list[str], out_dir: str | Path) -> Path:
    from huggingface_hub import ModelCard

    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    ModelCard(content).save(path / "README.md")
    return path / "README.md"
