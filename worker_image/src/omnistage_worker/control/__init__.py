"""Control of the one model: sleep and wake, transitions, ACKs, epochs, demand, loading."""
