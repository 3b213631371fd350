"""The reference: scikit-learn's own MLPClassifier (one hidden layer of 128, Adam) on the same split.

    python reference.py
"""
from sklearn.neural_network import MLPClassifier

from digits import split

x_train, x_val, y_train, y_val = split()
classifier = MLPClassifier(hidden_layer_sizes=(128,), max_iter=500, random_state=0).fit(x_train, y_train)
print(f"scikit-learn MLPClassifier: val accuracy {classifier.score(x_val, y_val):.4f} "
      f"({len(y_train)} training, {len(y_val)} validation samples)")
