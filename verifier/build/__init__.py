"""The build stage: the load_inline allow-list, the compile worker, the build cache, the precompiled
header, the split build and the check of built artefacts."""
