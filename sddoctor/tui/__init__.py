"""`sddoctor tui`: the Textual app. Reads sddoctor.gpu and run telemetry."""
