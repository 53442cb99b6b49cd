"""`sddoctor check-nccl`: environment checks and a real collective bandwidth test."""
