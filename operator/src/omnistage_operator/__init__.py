"""omnistage operator: reconciles OmniStage resources and arbitrates GPU memory per colocation group."""
