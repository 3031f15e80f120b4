"""omnistage operator: reconciles OmniStages and arbitrates GPU memory per colocation group."""
