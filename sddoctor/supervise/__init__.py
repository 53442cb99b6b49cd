"""`sddoctor run`: launch a DDP job, watch its ranks, diagnose, report."""
