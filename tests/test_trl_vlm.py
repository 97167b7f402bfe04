"""A vision-language GRPO run through stock ``GRPOTrainer`` and ``TLTGRPOTrainer``: the same outcome.

TLTGRPOTrainer keeps TRL's own generation for vision-language models (speculation off): the rollouts, rewards,
losses and completion statistics must be those of stock TRL, while the drafter still learns from the stock rollouts
and TLT's metrics still log. The model is a tiny random LLaVA (a 1-layer CLIP vision tower, a 2-layer Llama) built
from its config, and the processor is built in code (a character tokenizer with an ``<image>`` token, LLaVA's image
processor at 28x28): nothing is downloaded.

Rollouts are greedy, so both trainers see the same completions. Greedy groups hold identical completions, whose
gradients cancel: the policy barely moves. The sampled run (same seed; both trainers sample with TRL's generate from
the global RNG) has distinct completions and real updates, so its second step checks the updated policies agree.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("PIL")

from datasets import Dataset  # noqa: E402
from PIL import Image  # noqa: E402
from test_trl_compat import GREEDY, assert_same_outcome, recording  # noqa: E402
from tiny_models import BOS, EOS, PAD  # noqa: E402
from transformers import (  # noqa: E402
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_scripts.common import Recorder, grpo_kwargs  # noqa: E402

from tlt_trainers import TLTGRPOTrainer  # noqa: E402

try:  # transformers 5 keeps the numpy/PIL image processors apart from the torchvision ones
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil as ImageProcessor
except ImportError:  # pragma: no cover - older transformers
    from transformers import LlavaImageProcessor as ImageProcessor

IMAGE = 3  # the <image> token's id
VOCAB = 64
SIDE = 28  # two 14-pixel patches a side: 4 image tokens per image (CLS dropped)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %};{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
VLM_REASON = "vision-language models keep TRL's generation (speculation off)"
ROLLOUTS = {"greedy": dict(GREEDY), "sampled": {"do_sample": True, "temperature": 1.0}}


def processor() -> LlavaProcessor:
    """LLaVA's processor around a character-level tokenizer with an ``<image>`` special token (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,:;()ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: VOCAB - 4]
    vocab = {"<pad>": PAD, "</s>": EOS, "<s>": BOS, "<image>": IMAGE, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        bos_token="<s>", padding_side="left",
                                        extra_special_tokens={"image_token": "<image>"})
    images = ImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def vlm_policy() -> LlavaForConditionalGeneration:
    """A random tiny LLaVA with sharp next-token distributions (greedy ties are then vanishingly rare)."""
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD,
                       eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=SIDE, patch_size=14)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def image_dataset() -> Dataset:
    colours = [(255, 0, 0), (0, 160, 0), (0, 0, 255), (200, 200, 40)]
    questions = ["what color?", "name it:", "2+2=", "is it red?"]
    gen = torch.Generator().manual_seed(0)
    images = []
    for colour in colours:  # a colour plus noise, so the vision tower's features differ across pixels and images
        pixels = torch.tensor(colour).view(1, 1, 3) + torch.randint(-40, 41, (SIDE, SIDE, 3), generator=gen)
        images.append(Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy()))
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}] for q in questions],
        "images": [[image] for image in images],
    })


def content_reward(completions, **kwargs):
    """The answer's length plus its place in the batch: no group has zero reward spread (sampled groups then give
    real updates; a greedy group's identical completions still cancel)."""
    return [len(c[0]["content"]) / 8.0 + 0.5 * i for i, c in enumerate(completions)]


def run_vlm(trainer_cls, tmp_path, generation_kwargs):
    kwargs = grpo_kwargs(tmp_path / trainer_cls.__name__, generation_kwargs=dict(generation_kwargs), num_generations=2,
                         per_device_train_batch_size=4, max_completion_length=6, max_steps=2)
    reward, seen = recording(content_reward)
    recorder = Recorder()
    trainer = trainer_cls(model=vlm_policy(), reward_funcs=[reward], args=GRPOConfig(**kwargs),
                          train_dataset=image_dataset(), processing_class=processor(), callbacks=[recorder])
    trainer.train()
    return trainer, recorder, seen


def undefined(value) -> bool:
    """A ratio over zero engine steps: NaN, which the trainer's log writes as None."""
    return value is None or math.isnan(value)


@pytest.mark.parametrize("rollouts", sorted(ROLLOUTS))
def test_vision_language_run_has_the_stock_outcome(tmp_path, rollouts):
    stock = run_vlm(GRPOTrainer, tmp_path, ROLLOUTS[rollouts])
    ours = run_vlm(TLTGRPOTrainer, tmp_path, ROLLOUTS[rollouts])
    trainer, recorder, seen = ours

    assert stock[0]._is_vlm and trainer._is_vlm
    assert trainer._tlt_stock_reason == VLM_REASON
    assert len(seen) == 2 and all(len(batch) == 4 for batch in seen)  # two steps of 2 prompts x 2 generations
    assert_same_outcome(stock, ours)  # same completions each step, same loss/reward/lengths/grad norms
    if rollouts == "sampled":  # distinct completions in a group: the policy really moved before step 2
        assert len({c for batch in seen for c in batch}) == 8
        assert all(log["grad_norm"] > 0.1 for log in stock[1].logs if "grad_norm" in log)

    step_logs = [log for log in recorder.logs if "tlt/draft_tokens" in log]
    assert len(step_logs) == 2
    for log in step_logs:  # no speculation: nothing drafted, accepted or proposed, no engine steps to take ratios of
        assert log["tlt/draft_tokens"] == 0 and log["tlt/accepted_tokens"] == 0
        assert log["tlt/history_proposed_tokens"] == 0
        assert undefined(log["tlt/acceptance_length"]) and undefined(log["tlt/speculative_step_fraction"])
        assert log["tlt/rollout_seconds"] > 0
        assert log["tlt/drafter_steps"] > 0  # the drafter learns from the stock rollouts every step
        assert math.isfinite(log["tlt/drafter_loss"]) and 0 <= log["tlt/drafter_top1"] <= 1  # it trained
    assert trainer.drafter_trainer.step > 0
    assert [update["trigger"] for update in recorder.updates] == ["post_rollout", "post_rollout"]
