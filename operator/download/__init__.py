"""Model downloads into the model cache volume (`pagoda-model-download`, run by the operator's download Job).

hf:// sources go through `huggingface_hub` (with hf-xet, or hf_transfer when installed) into a Hugging Face
cache laid out as the engine reads it (HF_HOME); s3:// sources through boto3 into a plain directory. Both
resume what an earlier run left, check every file's size (and SHA-256 of LFS files, MD5 of single-part S3
objects), write a marker once complete so a rerun returns at once, and report progress as JSON lines the
operator reads from the pod's log. Credentials come from the environment (HF_TOKEN, AWS_*) and are never
printed: every message goes through `redact`.

The operator image runs it (it carries `pagoda[operator,download]`, no torch): it is small, so the Job starts
as fast as its node can pull it, and it is the image the chart already names.
"""

from pagoda.operator.download.result import DownloadError, Result

__all__ = ["DownloadError", "Result"]
