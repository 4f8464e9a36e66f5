// The page: tabs, the API key dialog, and starting the two views.
import { apiFetch, apiKey, setApiKey, Unauthorized } from "./api.js";
import { Dashboard } from "./dashboard.js";
import { Playground } from "./playground.js";

const keyDialog = document.getElementById("key-dialog");
const keyInput = document.getElementById("key-input");
let keyWaiters = [];

// Resolves once the user saved a key (every caller that hit a 401 retries then).
function askForKey() {
  if (!keyDialog.open) {
    keyInput.value = apiKey();
    keyDialog.showModal();
  }
  return new Promise((resolve) => keyWaiters.push(resolve));
}

keyDialog.addEventListener("close", () => {
  if (keyDialog.returnValue === "save") setApiKey(keyInput.value.trim());
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve());
});
document.getElementById("key-button").addEventListener("click", () => askForKey());

for (const tab of document.querySelectorAll("button.tab")) {
  tab.addEventListener("click", () => {
    for (const other of document.querySelectorAll("button.tab")) {
      other.setAttribute("aria-selected", String(other === tab));
      document.getElementById(other.dataset.tab).hidden = other !== tab;
    }
    window.dispatchEvent(new Event("resize"));  // charts size themselves to visible panels
  });
}

async function modelName() {
  for (;;) {
    try {
      const response = await apiFetch("/v1/models");
      if (response.ok) return (await response.json()).data[0].id;
    } catch (error) {
      if (error instanceof Unauthorized) await askForKey();
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

const dashboard = new Dashboard(document.getElementById("dashboard"), document.getElementById("status"), askForKey);
dashboard.connect();
const playground = new Playground(askForKey);
modelName().then((name) => {
  document.getElementById("model").textContent = name;
  playground.setModel(name);
});
