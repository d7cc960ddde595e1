"""text-to-image: a diffusers pipeline draws one image from a fixed prompt, seed and latents, against the CPU
reference's image by PSNR and SSIM."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

from shared.contracts.enums import ErrorClass, Task, Verdict
from shared.hub.kinds import Refusal
from tasks.declaration import DTYPES, TaskDeclaration

# text-to-image: one prompt, seed, size and step count; the reference starts from the same latents (drawn on the
# CPU from the seed) with the same scheduler.
IMAGE_PROMPT = "A lighthouse on a rocky coast at sunset, oil painting"
IMAGE_SEED = 0
IMAGE_SIZE = 128  # pixels a side: latents of 16 x 16 under Stable Diffusion's VAE (a factor of 8)
IMAGE_STEPS = 8
IMAGE_GUIDANCE = 5.0  # classifier-free guidance: the denoiser runs on a batch of two, as users run it


@dataclass(frozen=True)
class ImageTolerances:
    """What the text-to-image verdict tolerates, per run dtype: the decoded image's PSNR (dB) and SSIM against the
    reference's; both must hold. Measured by bench/calibrate_verdict.py --tasks (BENCHMARKS.md, *Verdict
    calibration: embeddings and images*): the thresholds sit between benign runs and planted faults."""

    psnr_db: float
    ssim: float

    @classmethod
    def for_dtype(cls, dtype: str) -> ImageTolerances:
        if dtype == "float32":  # 8 fp32 runs on the CPU drew the reference's image exactly (100 dB, SSIM 1): the
            return cls(psnr_db=45.0, ssim=0.999)  # bounds leave an accelerator's fp32 reduction order room
        # bf16, measured on 16 benign runs of a UNet and a DiT pipeline (4 seeds, 1 and 2 threads): PSNR 44.4 dB and
        # SSIM 0.9989 at worst; a dropped denoiser block reaches 32.2 dB / 0.987 at best. 38 dB and 0.99 sit between,
        # ~6 dB from each side; a 10 % scaled attention shard moves these tiny images by < 2 dB and stays a miss.
        return cls(psnr_db=38.0, ssim=0.99)


# The version of its rule (PSNR and SSIM against the reference's image): bumped by hand when its logic changes.
RULE_VERSION = 8  # the number every task's config carried when each task got its own: the test is the same


def config() -> dict[str, object]:
    tolerances = {dtype: asdict(ImageTolerances.for_dtype(dtype)) for dtype in DTYPES}
    return {"prompt": IMAGE_PROMPT, "seed": IMAGE_SEED, "size": IMAGE_SIZE, "steps": IMAGE_STEPS,
            "guidance": IMAGE_GUIDANCE, "rule": RULE_VERSION, "tolerances": tolerances}  # fmt: skip


def pipeline_refusal(model_id: str, files: Collection[str], tags: Collection[str]) -> Refusal | None:
    """SKIPPED for a text-to-image repo that is no diffusers pipeline (no ``model_index.json``): a LoRA (an adapter,
    without the base pipeline) or a single-file checkpoint, which a pipeline's from_pretrained does not load."""
    if "model_index.json" in files:
        return None
    if "lora" in tags or any("lora" in f.lower() for f in files if f.endswith(".safetensors")):
        reason = f"{model_id} is a LoRA for a diffusers pipeline, without the pipeline itself: test its base model"
        return Refusal(Verdict.SKIPPED, ErrorClass.adapter, reason)
    reason = f"{model_id} has no model_index.json: not a diffusers pipeline's layout (a single-file checkpoint?)"
    return Refusal(Verdict.SKIPPED, ErrorClass.weights_format, reason)


DECLARATION = TaskDeclaration(
    Task.text_to_image,
    summary="one image from a fixed prompt, seed and latents, within a PSNR and SSIM of the CPU reference's",
    pipeline_tags=("text-to-image",),
    config=config,
    libraries=("diffusers",),
    config_file="model_index.json",
    refusal=pipeline_refusal,
)
