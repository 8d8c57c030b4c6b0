"""Process plumbing: engine processes and their pipes, children following their parent, the engines' priority,
the reports of `--processes` fronts; `engines` chooses an engine process or an engine in this process."""
