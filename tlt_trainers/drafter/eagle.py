"""EagleDrafter: one decoder layer over the policy's own hidden states (EAGLE).

The drafter predicts the policy's next final hidden state h_{t+1} from fc([embed(x_{t+1}); h_t]),
and reads tokens through the policy's LM head. Embedding and head are the policy's modules,
held by reference and never registered as the drafter's parameters: the drafter cannot change
the policy, and its checkpoints hold only what it learned.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..modeling.kv_cache import RowKV
from ..modeling.target import apply_logit_transform, logit_transform, text_config
from .base import Drafter
from .config import WEIGHTS_NAME, EagleDrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [B, 1, q, D] for integer positions [B, q]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def project(self, x, positions):
        """Rotated queries [B, heads, q, D] and keys/values [B, kv_heads, q, D]."""
        b, q, _ = x.shape
        query = self.q_proj(x).view(b, q, self.heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, self.head_dim, self.theta, x.dtype)
        return rotate(query, cos, sin), rotate(key, cos, sin), value

    def attend(self, query, key, value, mask):
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        b, _, q, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))

    def forward(self, x, positions, mask, kv: RowKV | None = None, slots=None, kv_len=None):
        query, key, value = self.project(x, positions)
        if kv is not None:
            key, value = kv.write(key, value, slots, kv_len)
        return self.attend(query, key, value, mask)


class DrafterMLP(nn.Module):
    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TargetModules:
    """Plain holder so that the policy's modules are not registered as the drafter's submodules."""

    def __init__(self, embed: nn.Module, head: nn.Module):
        self.embed, self.head = embed, head


class EagleDrafter(Drafter):
    """A one-layer EAGLE drafter bound to a policy's embedding and LM head."""

    def __init__(self, config: EagleDrafterConfig, target: nn.Module | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        # Module names and the optional norm follow EAGLE-1 as vLLM and SGLang load it (llama_eagle): the
        # first layer has no input norm, fc has no bias, and the layer's output feeds the LM head directly.
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps) if config.input_layernorm else nn.Identity()
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)
        if config.uses_draft_vocab:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self._target: _TargetModules | None = None
        self._head_cache: tuple | None = None
        if target is not None:
            self.bind(target)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_target(cls, model: nn.Module, **overrides) -> EagleDrafter:
        """A fresh drafter sized for ``model``; ``overrides`` set any EagleDrafterConfig field."""
        config = text_config(model)
        softcap, scale = logit_transform(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        values = dict(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
            vocab_size=model.get_output_embeddings().weight.shape[0],
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            final_logit_softcapping=softcap,
            logit_scale=scale,
            target_model_type=getattr(config, "model_type", None),
            target_name_or_path=getattr(config, "_name_or_path", None) or None,
        )
        unknown = sorted(set(overrides) - set(values) - {"draft_vocab_size"})
        if unknown:
            raise TypeError(f"EagleDrafter.from_target got unknown settings {unknown}.")
        values.update(overrides)
        drafter = cls(EagleDrafterConfig(**values))
        weight = model.get_output_embeddings().weight
        drafter.to(device=weight.device, dtype=weight.dtype)
        drafter.bind(model)
        return drafter

    def bind(self, model: nn.Module) -> EagleDrafter:
        """Attach the policy's embedding and LM head (by reference); check that shapes agree."""
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(model).__name__} exposes no input/output embeddings; cannot attach a drafter.")
        target_hidden = embed.weight.shape[1]
        if target_hidden != self.config.hidden_size:
            raise ValueError(
                f"Drafter hidden_size={self.config.hidden_size} does not match the policy's {target_hidden}: this "
                "drafter was made for another model. Create one with EagleDrafter.from_target(model)."
            )
        if head.weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"Drafter vocab_size={self.config.vocab_size} does not match the policy's LM head "
                f"({head.weight.shape[0]} tokens): load the drafter trained for this model or use "
                "EagleDrafter.from_target(model)."
            )
        softcap, scale = logit_transform(text_config(model))
        if softcap != self.config.final_logit_softcapping or abs(scale - self.config.logit_scale) > 1e-6:
            raise ValueError("The drafter's logit soft-capping/scale differs from the policy's; recreate it with "
                             "EagleDrafter.from_target(model).")
        self._target = _TargetModules(embed, head)
        self._head_cache = None
        return self

    def ensure_bound(self, model: nn.Module) -> EagleDrafter:
        """Bind to ``model`` unless already bound to its head, and check that device and dtype agree."""
        if self._target is None or self.target.head is not model.get_output_embeddings():
            self.bind(model)
        mine, theirs = next(self.parameters()), model.get_output_embeddings().weight
        if mine.device != theirs.device or mine.dtype != theirs.dtype:
            raise ValueError(
                f"Drafter is on {mine.device}/{mine.dtype} but the policy on {theirs.device}/{theirs.dtype}: "
                "call drafter.to(device=..., dtype=...) to match."
            )
        return self

    @property
    def target(self) -> _TargetModules:
        if self._target is None:
            raise RuntimeError("This drafter is not bound to a policy: call drafter.bind(model) or pass target=model.")
        return self._target

    # ----------------------------------------------------------------- vocabulary
    @property
    def feature_size(self) -> int:
        """EAGLE-1 reads the policy's last hidden state: the policy's hidden size."""
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size if self.config.uses_draft_vocab else self.config.vocab_size

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over ``token_ids`` (target ids, e.g. the most frequent tokens); verification stays full-vocabulary."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() != self.draft_vocab_size or not self.config.uses_draft_vocab:
            raise ValueError(
                f"set_draft_vocab needs exactly draft_vocab_size={self.draft_vocab_size} ids and a drafter created "
                "with draft_vocab_size < vocab_size."
            )
        in_range = 0 <= token_ids.min() and token_ids.max() < self.config.vocab_size
        if not in_range or token_ids.unique().numel() != len(token_ids):
            raise ValueError("Draft vocabulary ids must be distinct token ids of the policy's vocabulary.")
        self.d2t.copy_(token_ids.sort().values.to(self.d2t.device))
        self._head_cache = None

    def head_weight(self) -> torch.Tensor:
        """The LM head rows the drafter scores, re-sliced only when the policy's head changes."""
        weight = self.target.head.weight
        if self.d2t is None:
            # Detached: a drafter loss must never put a gradient into the policy's head (.grad of a frozen,
            # shared weight would leak into the policy's next optimizer step).
            return weight.detach()
        key = (weight.data_ptr(), weight._version, self.d2t._version)
        if self._head_cache is None or self._head_cache[0] != key:
            self._head_cache = (key, weight.detach()[self.d2t])
        return self._head_cache[1]

    # ----------------------------------------------------------------- compute
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.target.embed(tokens)

    def forward(self, hidden, next_tokens, positions, mask=None, kv: RowKV | None = None, slots=None, kv_len=None):
        """Predicted next hidden states [B, q, H] from policy features ``hidden`` [B, q, H] and tokens [B, q].

        ``mask`` is an additive attention mask [B, 1, q, kv]; with ``kv`` the keys are written at ``slots``.
        Without a cache the mask defaults to causal.
        """
        x = self.fc(torch.cat([self.embed(next_tokens).to(hidden.dtype), hidden], dim=-1))
        if mask is None and kv is None:
            q = x.shape[1]
            mask = torch.full((q, q), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, kv, slots, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_unrolled(self, hidden, next_tokens, positions, valid, depth: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): predictions [B, L, H] at each of ``depth`` chained draft steps.

        Step 0 reads the policy's features. Step d at position t reads step d-1's prediction at t-1 in place
        of the real feature, and attends, as at inference, to real-feature keys up to t-d and to the keys of
        the steps before it on its own diagonal (positions t-d+1 .. t). ``valid`` [B, L] marks real pairs.
        """
        batch, length, _ = hidden.shape
        device, dtype = hidden.device, hidden.dtype
        embedded = self.embed(next_tokens).to(dtype)
        idx = torch.arange(length, device=device)
        minimum = torch.finfo(dtype).min
        keys, values, outputs = [], [], []
        features = hidden
        for step in range(depth):
            if step > 0:  # shift: position t reads the previous step's prediction made at t-1
                features = torch.cat([hidden[:, :1], outputs[-1][:, :-1]], dim=1)
            x = self.fc(torch.cat([embedded, features], dim=-1))
            query, key, value = self.self_attn.project(self.input_layernorm(x), positions)
            keys.append(key)
            values.append(value)
            # Real keys s <= t - step (s <= t for step 0), then step j's key at t - step + j on the diagonal.
            blocks = [(idx[None, :] <= idx[:, None] - step) & valid[:, None, :]]
            for j in range(1, step + 1):
                blocks.append((idx[None, :] == idx[:, None] - step + j).expand(batch, -1, -1))
            allowed = torch.cat(blocks, dim=-1)
            own = torch.zeros_like(allowed)
            own[:, idx, step * length + idx] = True  # a query always sees itself: no empty softmax rows
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~(allowed | own), minimum)
            attn = self.self_attn.attend(query, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask[:, None])
            x = x + attn
            outputs.append(x + self.mlp(self.post_attention_layernorm(x)))
        return outputs

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (index with ``d2t`` to get target ids)."""
        logits = F.linear(predicted, self.head_weight()).to(torch.float32)
        return apply_logit_transform(logits, self.config.final_logit_softcapping, self.config.logit_scale)

    def new_kv(self, capacity: int) -> RowKV:
        return RowKV(capacity)

    # ----------------------------------------------------------------- persistence
    def save_pretrained(self, save_directory: str | os.PathLike, model_card: dict | None = None) -> None:
        """config.json + model.safetensors: the drafter's own weights and d2t, never the policy's.

        ``model_card``: keyword arguments of :func:`tlt_trainers.drafter.model_card.write_model_card` (``policy_name``,
        ``acceptance``, ...); when given, a README.md model card is written next to the weights.
        """
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "architecture": "EagleDrafter"})
        if model_card is not None:
            from .model_card import write_model_card

            write_model_card(self, path, **model_card)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: nn.Module | None = None, **hub_kwargs) -> EagleDrafter:
        """Load from a directory (or a Hub repo id, downloaded with huggingface_hub) and bind to ``target``."""
        directory = Path(path)
        if not directory.is_dir():
            text = str(path)
            if directory.exists() or directory.is_absolute() or text.startswith(".") or text.count("/") > 1:
                raise FileNotFoundError(
                    f"No drafter directory at {text}; pass a folder written by EagleDrafter.save_pretrained "
                    "or a Hub repo id ('namespace/name')."
                )
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(str(path), **hub_kwargs))
        config = EagleDrafterConfig.load(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing; the drafter at {directory} is incomplete.")
        drafter = cls(config)
        state = load_file(str(weights))
        try:
            missing, unexpected = drafter.load_state_dict(state, strict=False)
        except RuntimeError as err:  # a tensor whose shape disagrees with config.json
            raise ValueError(f"Drafter weights at {weights} do not match its config: {err}") from err
        if missing or unexpected:
            raise ValueError(
                f"Drafter weights at {weights} do not match its config (missing {missing}, unexpected {unexpected})."
            )
        if target is not None:
            weight = target.get_output_embeddings().weight
            drafter.to(device=weight.device, dtype=weight.dtype)
            drafter.bind(target)
        return drafter

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload EagleDrafter", model_card: dict | None = None) -> str:
        """Save to a temporary directory with a README.md model card and upload it as a model repo.

        ``model_card``: keyword arguments of ``write_model_card`` (``policy_name`` defaults to the policy the drafter
        was made for, ``repo_id`` to this repo). Returns the commit URL.
        """
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, model_card={"repo_id": repo_id, **(model_card or {})})
            info = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message)
        return str(info)
