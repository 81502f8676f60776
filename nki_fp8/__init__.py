"""FP8 KV cache numerics: formats, scales, calibration, scale-folded attention references."""
