"""The `fgpu` command line: its entry point and the commands that are not long-running servers."""
