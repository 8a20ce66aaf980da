"""DFlash (arXiv 2602.06036): block-diffusion drafting conditioned on the target's hidden states."""
