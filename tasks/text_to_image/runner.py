"""text-to-image: a diffusers pipeline draws one image from a fixed prompt, accelerator vs CPU reference.

The pipeline is loaded from the repo's Hub layout (``model_index.json``) by ``DiffusionPipeline.from_pretrained``;
its denoiser (a UNet or a transformer: what runs at every step) is compiled with the backend, the text encoder and
the VAE run as the pipeline runs them. Both runs start from the same latents, drawn on the CPU from the test's
seed, with the repo's own scheduler, prompt, size, step count and guidance (``tasks.text_to_image``). Resolution
binning is off and PixArt's caption cleaning too (it needs packages outside the pipeline): the image is drawn at
the size asked. Verdict: PASS when the decoded image's PSNR and SSIM against the reference's both reach the
dtype's tolerances (``ImageTolerances``), else FAIL. Both images are kept, small, as the row's evidence.
"""

from __future__ import annotations

import base64
import inspect
import io
import statistics
import time
from importlib.metadata import version
from typing import Any

import numpy as np

from services.runner import faults
from services.runner.backends.base import Backend
from services.runner.failures import RunFailure, phase
from services.runner.measure import accelerator_timings, compile_record
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import ComparesOutputs, Conclusion
from services.runner.tasks.whole import compiled_twice
from shared.contracts.enums import ErrorClass, Fault, Parallelism, Task, Verdict
from shared.contracts.handoffs import AcceleratorData, Artifacts
from shared.contracts.report import Comparison, Output, Resources
from tasks.text_to_image import IMAGE_GUIDANCE, IMAGE_PROMPT, IMAGE_SEED, IMAGE_SIZE, IMAGE_STEPS, ImageTolerances

DENOISERS = ("unet", "transformer")  # the pipeline components that run at every step, as diffusers names them
PSNR_CAP_DB = 100.0  # identical images: PSNR is infinite, which no column or JSON holds
THUMBNAIL = 64  # pixels a side of the images kept as evidence


class Pipeline:
    """A loaded diffusers pipeline and its denoiser; ``draw()`` makes the test's image."""

    def __init__(self, spec: AcceleratorSpec | ReferenceSpec, backend: Backend, accelerated: bool) -> None:
        import torch
        from diffusers import DiffusionPipeline

        if not (spec.model_dir / "model_index.json").is_file():
            raise RunFailure(ErrorClass.load, "no model_index.json: text-to-image runs diffusers pipelines")
        self.dtype = getattr(torch, backend.dtype)
        self.device = backend.device if accelerated else "cpu"
        pipe = DiffusionPipeline.from_pretrained(
            spec.model_dir, dtype=self.dtype, trust_remote_code=spec.trust_remote_code
        )
        self.pipe = pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        name = next((n for n in DENOISERS if getattr(self.pipe, n, None) is not None), None)
        if name is None:
            raise RunFailure(ErrorClass.load, f"{type(self.pipe).__name__} has neither a unet nor a transformer")
        self.denoiser = getattr(self.pipe, name)
        # a step's end is when the accelerator finished it; the CPU reference has nothing to wait for
        self.synchronize = backend.synchronize if accelerated else (lambda: None)
        self.step_ends: list[float] = []

    @property
    def network(self) -> Any:
        return self.denoiser

    def plant(self, fault: str) -> None:
        if fault == Fault.wrong_pooling:
            raise ValueError("wrong_pooling is a fault of a sentence-transformers pipeline, not of an image model")
        faults.inject_module(self.denoiser, fault)

    def output(self) -> Output:
        return Output(
            pipeline_library="diffusers",
            pipeline_library_version=version("diffusers"),
            denoiser=type(self.denoiser).__name__,
            image_size=IMAGE_SIZE,
            denoising_steps=IMAGE_STEPS,
        )

    def draw(self) -> np.ndarray:
        """The image (height x width x RGB in [0, 1]); the end of each denoising step in ``step_ends``."""
        import torch

        config = self.denoiser.config
        side = IMAGE_SIZE // self.pipe.vae_scale_factor
        generator = torch.Generator("cpu").manual_seed(IMAGE_SEED)
        latents = torch.randn((1, config.in_channels, side, side), generator=generator, dtype=torch.float32)
        accepted = inspect.signature(self.pipe.__call__).parameters
        extra: dict[str, Any] = {k: False for k in ("use_resolution_binning", "clean_caption") if k in accepted}
        if "generator" in accepted:  # the noise a scheduler adds at each step, the same on both sides (CPU-drawn)
            extra["generator"] = generator
        self.step_ends = []

        def step_ended(*args: Any) -> dict[str, Any] | None:
            self.synchronize()
            self.step_ends.append(time.perf_counter())
            return args[-1] if len(args) == 4 else None  # callback_on_step_end hands its kwargs back

        # Pipelines take a step callback of one of two generations, the newer or ``callback`` with its steps, or
        # none (then the row has no time per step)
        if "callback_on_step_end" in accepted:
            extra["callback_on_step_end"] = step_ended
        elif "callback" in accepted:
            extra |= {"callback": step_ended, "callback_steps": 1}

        with torch.inference_mode():
            started = time.perf_counter()
            result = self.pipe(
                IMAGE_PROMPT,
                height=IMAGE_SIZE,
                width=IMAGE_SIZE,
                num_inference_steps=IMAGE_STEPS,
                guidance_scale=IMAGE_GUIDANCE,
                latents=latents.to(self.device, self.dtype),
                output_type="np",
                **extra,
            )
        self.step_ends.insert(0, started)
        return np.asarray(result.images[0], dtype=np.float32)

    def median_step_s(self) -> float | None:
        """The median denoising step of the last draw (the first also holds the text encoding); None for a
        pipeline that reports no steps."""
        steps = [b - a for a, b in zip(self.step_ends, self.step_ends[1:], strict=False)]
        return statistics.median(steps) if steps else None


def picture(image: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8))


def thumbnail(image: np.ndarray) -> str:
    """A small PNG of ``image``, base64: the evidence a results page shows."""
    buffer = io.BytesIO()
    picture(image).resize((THUMBNAIL, THUMBNAIL)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def agreement(produced: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """PSNR (dB, capped) and SSIM of two images in [0, 1], as scikit-image computes them."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    if np.array_equal(produced, expected):
        return PSNR_CAP_DB, 1.0
    psnr = min(float(peak_signal_noise_ratio(expected, produced, data_range=1.0)), PSNR_CAP_DB)
    return psnr, float(structural_similarity(expected, produced, data_range=1.0, channel_axis=-1))


class TextToImage(ComparesOutputs):
    name = Task.text_to_image

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        pipeline, image, clock = compiled_twice(
            spec, backend, "a diffusers pipeline", lambda: Pipeline(spec, backend, accelerated=True), Pipeline.draw
        )
        timings = accelerator_timings(clock).model_copy(update={"denoise_step_s": pipeline.median_step_s()})
        return AcceleratorData(
            image=np.nan_to_num(image).tolist(),  # JSON holds no NaN: ``finite`` says whether there was one
            finite=bool(np.isfinite(image).all()),
            output=pipeline.output(),
            placement=backend.placement().model_copy(update={"parallelism": Parallelism.none}),
            timings=timings,
            resources=Resources(
                peak_memory_bytes=backend.peak_memory_bytes(), **compile_record(pipeline.denoiser, backend)
            ),
        )

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        with phase(ErrorClass.load):
            pipeline = Pipeline(spec, backend, accelerated=False)
        with phase(ErrorClass.runtime):
            return ReferenceResult(data={"image": pipeline.draw().tolist()})

    def conclude(self, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str) -> Conclusion:
        produced = np.asarray(acc.image, dtype=np.float32)
        expected = np.asarray(found.data["image"], dtype=np.float32)
        tolerances = ImageTolerances.for_dtype(dtype)
        drawn = {"accelerator": produced, "reference": expected}
        for side, image in drawn.items():  # whole, beside the job's other artifacts; small in the row
            picture(image).save(artifacts.images[side])
        images = {side: thumbnail(image) for side, image in drawn.items()}
        if not acc.finite:
            comparison = Comparison(reference_reused=found.reused, evidence={"images": images})
            return Conclusion(Verdict.FAIL, "the accelerator's image has non-finite pixels", comparison)
        psnr, ssim = agreement(produced, expected)
        passed = psnr >= tolerances.psnr_db and ssim >= tolerances.ssim
        reason = (
            f"PSNR {psnr:.2f} dB {'>=' if psnr >= tolerances.psnr_db else '<'} {tolerances.psnr_db:g} and SSIM "
            f"{ssim:.4f} {'>=' if ssim >= tolerances.ssim else '<'} {tolerances.ssim:g} against the reference's image"
        )
        evidence = {"images": images, "tolerances": {"psnr_db": tolerances.psnr_db, "ssim": tolerances.ssim}}
        comparison = Comparison(image_psnr=psnr, image_ssim=ssim, reference_reused=found.reused, evidence=evidence)
        return Conclusion(Verdict.PASS if passed else Verdict.FAIL, reason, comparison)


RUNNER = TextToImage()
