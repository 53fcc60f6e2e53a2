"""Named profiles of the trainer's memory and speed settings: ``--profile lean`` instead of knowing
which four flags belong together. A profile fills the settings it names; a flag given on the
command line wins over its profile. The memory check's advice names the leanest profile that fits
(example_trainer/memory_plan.py); bench/memory.py measures these rows.

| profile | what it is for |
|---|---|
| default | fp32 master weights and AdamW: the most exact, 16 trainer bytes/param (+ activations) |
| lean | the shared bf16 weights stepped in place with 8-bit moments: ~4 bytes/param |
| lean4 | the same with 4-bit moments |
| offload | lean, with the moments in host memory between steps |
| offload-grads | offload, with the gradients in host memory too (one micro-batch): a 14B shape beside vLLM on an 80 GB GPU |
| fastest-8b | the 8B head-to-head's fastest: float8 moments, the staged step, torch.compile, each group's prompt once |
"""

from __future__ import annotations

PROFILES: dict[str, dict[str, object]] = {
    "default": {},
    "lean": {"bf16_inplace": True, "optimizer": "adamw8bit"},
    "lean4": {"bf16_inplace": True, "optimizer": "adamw4bit"},
    "offload": {"bf16_inplace": True, "optimizer": "adamw8bit", "offload_optimizer": True},
    # --staged-step keeps the gradients on the GPU, so this one goes without it; each extra
    # micro-batch would take the gradients to the GPU and back once more
    "offload-grads": {"bf16_inplace": True, "optimizer": "adamw8bit", "offload_optimizer": True,
                      "offload_gradients": True, "staged_step": False, "gradient_accumulation_steps": 1},
    "fastest-8b": {"bf16_inplace": True, "optimizer": "adamwfp8", "staged_step": True, "torch_compile": True,
                   "share_group_prefix": True},
}
# The profiles the memory check suggests, least change first.
LEANER_PROFILES = ("lean", "lean4", "offload", "offload-grads")


def with_profile(given: dict[str, object]) -> dict[str, object]:
    """The fields given on the command line, with their profile's settings for those not given
    (``given["profile"]``, if any); an unknown profile raises ValueError listing the known ones."""
    name = given.get("profile")
    if name is None:
        return dict(given)
    if name not in PROFILES:
        raise ValueError(f"--profile {name!r} is unknown; known: {', '.join(PROFILES)}")
    return {**PROFILES[name], **given}
