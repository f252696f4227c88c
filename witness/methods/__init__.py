"""Submitted training methods: a wheel read strictly (never executed here) and replayed only inside
the sandbox, with everything that is judged computed outside it."""
