"""Quality gates a model directory records for the server: which variant it may serve (the BLEU gate), which
length penalty each direction decodes with."""
