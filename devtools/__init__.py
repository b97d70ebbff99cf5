"""Developer tools: fakes and harnesses used by tests and the demo."""
