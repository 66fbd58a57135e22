"""The engine core: request state, scheduler, step loop. No Ray and no wire formats here."""
