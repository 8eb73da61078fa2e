"""The expert tiers: resident, host (pinned), compressed (GPU, lossless), quantized (GPU, lossy)."""
