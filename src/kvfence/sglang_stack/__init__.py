"""kvfence prefill and decode workers behind SGLang's own PD router (`sglang-router`)."""
