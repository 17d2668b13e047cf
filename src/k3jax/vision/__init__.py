"""Native vision: the MoonViT-V2 tower, patchmergerv2 projector, image processor and static patch buckets
(K3_VISION_SPEC). ``load_pretrained(path, vision=True)`` (:mod:`k3jax.io.hf`) gives a
:class:`K3ForConditionalGeneration`; :func:`process_image` turns files into patches."""

from k3jax.vision.config import IMAGE_PLACEHOLDER, MEDIA_PAD_ID, VT_NORM_EPS_MLX_VLM, VT_NORM_EPS_TORCH, \
    MediaConfig, VisionConfig, vision_config_of
from k3jax.vision.model import K3ForConditionalGeneration, MultimodalPrompt, PromptError, VisionEncoder, \
    splice_prompt
from k3jax.vision.packing import DEFAULT_BUCKETS, plan_packing
from k3jax.vision.processor import ImageError, ProcessedImage, process_image, target_size

__all__ = ["IMAGE_PLACEHOLDER", "MEDIA_PAD_ID", "VT_NORM_EPS_MLX_VLM", "VT_NORM_EPS_TORCH", "MediaConfig",
           "VisionConfig", "vision_config_of", "K3ForConditionalGeneration", "MultimodalPrompt", "PromptError",
           "VisionEncoder", "splice_prompt", "DEFAULT_BUCKETS", "plan_packing", "ImageError", "ProcessedImage",
           "process_image", "target_size"]
