"""What several of fgpu's packages share: files, flags, YAML files, sysfs, test hooks."""
