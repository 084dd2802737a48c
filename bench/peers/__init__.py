"""The real peer engines (vLLM CPU, llama.cpp's llama-server) as a cached, startable kit.

    from bench.peers import ensure_installed, start_vllm, start_llamacpp
    with start_llamacpp(ckpt_dir, ctx_size=4096) as peer:
        peer.url, peer.model, peer.log_path

Install with `make peers` (bench/peers/install.sh); the cache sits outside the clone.
"""

from .cache import (
    LLAMACPP_VERSION,
    VLLM_VERSION,
    PeerCache,
    PeerNotInstalled,
    ensure_installed,
)
from .gguf import ConversionError, checkpoint_hash, convert_to_gguf
from .server import (
    LlamaSlotLayout,
    PeerServer,
    PeerStartError,
    free_port,
    http_get,
    launch_server,
    llamacpp_n_ctx,
    llamacpp_n_ctx_seq,
    llamacpp_slot_layout,
    start_llamacpp,
    start_vllm,
    vllm_pool_tokens,
)

__all__ = [
    "LLAMACPP_VERSION",
    "VLLM_VERSION",
    "ConversionError",
    "LlamaSlotLayout",
    "PeerCache",
    "PeerNotInstalled",
    "PeerServer",
    "PeerStartError",
    "checkpoint_hash",
    "convert_to_gguf",
    "ensure_installed",
    "free_port",
    "http_get",
    "launch_server",
    "llamacpp_n_ctx",
    "llamacpp_n_ctx_seq",
    "llamacpp_slot_layout",
    "start_llamacpp",
    "start_vllm",
    "vllm_pool_tokens",
]
