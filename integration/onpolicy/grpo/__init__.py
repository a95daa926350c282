"""The GRPO loop: the prompt task and its reward, group advantages, the metric sinks."""
