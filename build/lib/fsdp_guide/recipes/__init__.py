"""Complete training scripts that run unchanged from a notebook (``fsdp_guide.launch``) and under ``torchrun``."""
