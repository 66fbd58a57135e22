"""The model side of Pagoda: torch only.

config (HF config.json -> ModelConfig) -> llama (layers that load their own weights, paged attention)
-> loader (safetensors -> weight_loader of each parameter) -> runner (a step's plan -> tensors ->
forward -> sampled tokens). cluster/model_fetch.py turns the default model's GGUF into an HF directory once.
"""
