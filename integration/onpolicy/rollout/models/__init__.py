"""The model classes an engine of this project loads, as SGLang's external model package
(SGLANG_EXTERNAL_MODEL_PACKAGE, set by `rollout.engine_env`).

With it SGLang's registry resolves the checkpoint's architecture from this package alone and
skips importing its ~200 default model modules, 4.7 CPU-s in every scheduler process on the
2-core machine. The classes are SGLang's own (patched by the series), unchanged.
"""
