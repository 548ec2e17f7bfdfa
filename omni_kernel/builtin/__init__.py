"""The kernel's built-in plugin (the echo pipeline), registered through the same hooks as any third-party plugin."""
