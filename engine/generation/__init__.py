"""Generation: forward steps over the paged cache, sampling, stop conditions, the Generator."""
