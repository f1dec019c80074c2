<?php

/**
 * phorge-bridge: the Conduit methods that let phorge-bridge run Phorge's task
 * queue from Celery while Phorge's own PHP workers keep doing the work.
 *
 *   - worker.execute runs one leased task's worker in this PHP process (or
 *     several, in order, in one request) and reports each outcome; it never
 *     reads or writes the queue tables (the bridge owns the leases and
 *     records the outcomes itself).
 *   - worker.feedstory returns what FeedPublisherHTTPWorker would POST for a
 *     feed story, so the bridge can deliver feed.http-hooks itself.
 *   - worker.version reports the installed release and its files' sha256,
 *     so "phorge-bridge doctor" can tell a missing or outdated copy.
 *
 * All three methods are callable only by an authenticated administrator account
 * (typically a bot made administrator for the bridge, with an API token).
 *
 * Installed by "phorge-bridge phorge install-extension"; the installed copy
 * is overwritten on upgrade, so do not edit it. How a task runs lives in
 * PhorgeBridgeTaskRun.php, installed next to this file and shared with the
 * bridge's PHP runner; Phorge includes extension files in no particular
 * order, so this file requires it itself.
 *
 * Written for PHP 7.2 (Phorge's minimum): no arrow functions, typed
 * properties or other newer syntax.
 */
require_once dirname(__FILE__).'/PhorgeBridgeTaskRun.php';

abstract class PhorgeBridgeConduitAPIMethod extends ConduitAPIMethod {

  const ERR_PERMISSION = 'ERR-BRIDGE-PERMISSION';
  const ERR_PARAMETER = 'ERR-BRIDGE-PARAMETER';
  const ERR_READ_ONLY = 'ERR-BRIDGE-READ-ONLY';

  // The phorge-bridge release this file ships with (read by the bridge's
  // Python too); worker.version reports it with this file's sha256.
  const VERSION = '0.2.0.dev0';

  // These four make sure no configuration (policy.allow-public, OAuth
  // clients) can open the methods to anyone but an authenticated caller.
  final public function shouldRequireAuthentication() {
    return true;
  }

  final public function shouldAllowPublic() {
    return false;
  }

  final public function getRequiredScope() {
    return self::SCOPE_NEVER;
  }

  final public function getPolicy($capability) {
    // Hides the methods from non-administrators in the API console too.
    return PhabricatorPolicies::POLICY_ADMIN;
  }

  public function getMethodStatus() {
    return self::METHOD_STATUS_UNSTABLE;
  }

  public function getMethodStatusDescription() {
    return pht(
      'Internal method of phorge-bridge (the Celery task runner); its '.
      'parameters and results follow the bridge, not a public contract.');
  }

  protected function defineErrorTypes() {
    return array(
      self::ERR_PERMISSION => pht(
        'Only an authenticated administrator account may call this method.'),
      self::ERR_PARAMETER => pht('A parameter is missing or malformed.'),
      self::ERR_READ_ONLY => pht(
        'Phorge is in read-only mode; tasks can not run now.'),
    );
  }

  final protected function execute(ConduitAPIRequest $request) {
    $this->requireBridgeCaller($request);
    return $this->executeBridgeMethod($request);
  }

  abstract protected function executeBridgeMethod(ConduitAPIRequest $request);

  private function requireBridgeCaller(ConduitAPIRequest $request) {
    // getUser() throws when there is no user at all.
    $viewer = $request->getUser();

    $reason = null;
    if (!$viewer->isLoggedIn()) {
      // Anonymous, "public" and intracluster public users have no PHID.
      $reason = pht('The caller is not logged in.');
    } else if ($viewer->isOmnipotent()) {
      $reason = pht('The omnipotent user may not call this method.');
    } else if ($request->getOAuthToken()) {
      $reason = pht('OAuth access tokens may not call this method.');
    } else if (!$viewer->isUserActivated()) {
      $reason = pht('The calling account is disabled or not activated.');
    } else if ($viewer->getIsMailingList()) {
      $reason = pht('Mailing lists may not call this method.');
    } else if (!$viewer->getIsAdmin()) {
      $reason = pht(
        'The calling account ("%s") is not an administrator.',
        $viewer->getUsername());
    }

    if ($reason !== null) {
      throw id(new ConduitException(self::ERR_PERMISSION))
        ->setErrorDescription(
          pht(
            'Permission denied: %s Only an administrator account (for '.
            'example, a bot made administrator for phorge-bridge) may call '.
            '"%s".',
            $reason,
            $this->getAPIMethodName()));
    }
  }

  final protected function newParameterException($message) {
    return id(new ConduitException(self::ERR_PARAMETER))
      ->setErrorDescription($message);
  }

}


final class PhorgeBridgeWorkerExecuteConduitAPIMethod
  extends PhorgeBridgeConduitAPIMethod {

  public function getAPIMethodName() {
    return 'worker.execute';
  }

  public function getMethodDescription() {
    return pht(
      'Run one task of the worker queue in this process, or several in '.
      'order ("tasks"), on behalf of phorge-bridge, which holds their '.
      'leases. Reports each outcome (success, yield, permanent-failure or '.
      'failure) and returns the follow-up tasks the worker queued instead '.
      'of scheduling them. Does not read or write the queue tables. '.
      'Administrators only.');
  }

  protected function defineParamTypes() {
    return array(
      'taskID' => 'optional int',
      'taskClass' => 'optional string',
      'data' => 'optional string',
      'failureCount' => 'optional int',
      'priority' => 'optional int',
      'objectPHID' => 'optional phid|null',
      'containerPHID' => 'optional phid|null',
      'traceparent' => 'optional string|null',
      'tasks' => 'optional list<map<string, wild>>',
    );
  }

  protected function defineReturnType() {
    return 'dict<string, wild>';
  }

  /**
   * One task (its fields as parameters) answers its result; a batch ("tasks",
   * each one's fields) answers {"results": [...]}, one per task, in order:
   * the request's bootstrap and token check are paid once for them all. Every
   * task is checked before any runs, so a malformed batch runs nothing.
   */
  protected function executeBridgeMethod(ConduitAPIRequest $request) {
    $specs = $request->getValue('tasks');
    if ($specs === null) {
      $tasks = array($this->readTask($request->getAllParameters()));
    } else if (is_array($specs) && $specs && array_keys($specs) === range(0, count($specs) - 1)) {
      $tasks = array();
      foreach ($specs as $spec) {
        if (!is_array($spec)) {
          throw $this->newParameterException(
            pht('Each entry of parameter "tasks" must be a map of task fields.'));
        }
        $tasks[] = $this->readTask($spec);
      }
    } else {
      throw $this->newParameterException(
        pht('Parameter "tasks" must be a non-empty list of tasks.'));
    }

    if (PhabricatorEnv::isReadOnly()) {
      throw id(new ConduitException(self::ERR_READ_ONLY))
        ->setErrorDescription(
          pht(
            'Phorge is in read-only mode; task %d was not run.',
            $tasks[0]->getID()));
    }

    $results = array();
    foreach ($tasks as $task) {
      $results[] = PhorgeBridgeTaskRun::run($task);
    }
    return ($specs === null) ? head($results) : array('results' => $results);
  }

  private function readTask(array $spec) {
    // The spec is read and checked by the task run, as the runner's are.
    try {
      return PhorgeBridgeTaskRun::newTaskFromSpec($spec);
    } catch (PhorgeBridgeTaskSpecException $ex) {
      throw $this->newParameterException($ex->getMessage());
    }
  }

}


final class PhorgeBridgeFeedStoryConduitAPIMethod
  extends PhorgeBridgeConduitAPIMethod {

  public function getAPIMethodName() {
    return 'worker.feedstory';
  }

  public function getMethodDescription() {
    return pht(
      'For a feed story\'s chronological key, return the fields '.
      'FeedPublisherHTTPWorker would POST to feed.http-hooks, whether hooks '.
      'are silenced (phabricator.silent) and the allowed hook URIs, so '.
      'phorge-bridge can deliver the hook itself. Administrators only.');
  }

  protected function defineParamTypes() {
    return array(
      'key' => 'required string',
    );
  }

  protected function defineReturnType() {
    return 'dict<string, wild>';
  }

  protected function executeBridgeMethod(ConduitAPIRequest $request) {
    // Chronological keys exceed 2^53: they travel as strings.
    $key = $request->getValue('key');
    if (is_int($key)) {
      $key = (string)$key;
    }
    if (!is_string($key) || !preg_match('/^\d{1,20}\z/', $key)) {
      throw $this->newParameterException(
        pht('Parameter "key" must be a chronological key (a decimal string).'));
    }

    $silent = (bool)PhabricatorEnv::getEnvConfig('phabricator.silent');
    $hook_uris = PhabricatorEnv::getEnvConfig('feed.http-hooks');
    if (!is_array($hook_uris)) {
      $hook_uris = array();
    }

    // As FeedPushWorker::loadFeedStory().
    $story = id(new PhabricatorFeedQuery())
      ->setViewer(PhabricatorUser::getOmnipotentUser())
      ->withChronologicalKeys(array($key))
      ->executeOne();

    $fields = null;
    if ($story) {
      $data = $story->getStoryData();
      // The same fields, in the same order, as FeedPublisherHTTPWorker.
      $fields = array(
        'storyID' => $data->getID(),
        'storyType' => $data->getStoryType(),
        'storyData' => $data->getStoryData(),
        'storyAuthorPHID' => $data->getAuthorPHID(),
        'storyText' => $story->renderText(),
        'epoch' => $data->getEpoch(),
      );
    }

    return array(
      'key' => $key,
      'silent' => $silent,
      'hookURIs' => array_values($hook_uris),
      'story' => $fields,
      // What HTTPSFuture sends when no User-Agent is set, so the bridge's POST
      // carries the same one.
      'userAgent' => self::getHTTPUserAgent(),
    );
  }

  private static function getHTTPUserAgent() {
    $client = 'Arcanist/1.0';
    if (method_exists('BaseHTTPFuture', 'getDefaultUserAgent')) {
      $client = BaseHTTPFuture::getDefaultUserAgent();
    }
    if (!function_exists('curl_version')) {
      return $client;
    }
    $curl = curl_version();
    return $client.' cURL/'.idx($curl, 'version');
  }

}


final class PhorgeBridgeVersionConduitAPIMethod
  extends PhorgeBridgeConduitAPIMethod {

  public function getAPIMethodName() {
    return 'worker.version';
  }

  public function getMethodDescription() {
    return pht(
      'Report which phorge-bridge extension is installed: its release and '.
      'the sha256 of its files, which phorge-bridge doctor compares with the '.
      'copies it ships. Administrators only.');
  }

  protected function defineParamTypes() {
    return array();
  }

  protected function defineReturnType() {
    return 'dict<string, string>';
  }

  protected function executeBridgeMethod(ConduitAPIRequest $request) {
    return array(
      'version' => self::VERSION,
      'sha256' => self::getExtensionHash(),
    );
  }

  // The sha256 of the extension files' sha256 digests, in this order (the
  // bridge's Python computes the same of the files it ships: EXTENSION_FILES
  // in bridge/phorge/extension.py).
  private static function getExtensionHash() {
    $files = array(
      'PhorgeBridgeQueueDaemon.php',
      'PhorgeBridgeCanaryConfigOptions.php',
      'PhorgeBridgeTaskRun.php',
      'PhorgeBridgeCanary.php',
    );
    $digests = hash_file('sha256', __FILE__);
    foreach ($files as $file) {
      $digests .= hash_file('sha256', dirname(__FILE__).'/'.$file);
    }
    return hash('sha256', $digests);
  }

}
