"""Training on groups of samples that share a prompt (GRPO-style) with hydrajax attention."""
