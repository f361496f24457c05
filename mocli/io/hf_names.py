"""The file names of a Hugging Face checkpoint directory (transformers / huggingface_hub), as a leaf
every layer may import: the config parser reads them, the output formats write them."""

CONFIG_JSON = "config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's own copy of the quantization settings
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
